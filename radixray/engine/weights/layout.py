"""Where each Hugging Face weight goes in a running model, and staging new weights beside it.

:class:`WeightLayout` maps every checkpoint name (``layers.3.self_attn.k_proj.weight``,
with or without the ``model.`` prefix) onto a *target* of the model: a parameter
or the weight/bias of an int8 layer, and the rows of it the tensor fills (q, k
and v share the fused ``qkv_proj``; gate and up share ``gate_up_proj``). A
mixture-of-experts layer stacks its experts in one 3-D parameter per projection
(``mlp.experts.gate_up_proj`` [experts, 2 * inter, hidden]): each per-expert
checkpoint tensor (``mlp.experts.5.up_proj.weight``) fills rows of one expert's
slice, and the stacked name itself (how transformers keeps MoE weights in memory)
fills the whole parameter. Checkpoint names count *logical* experts; a model with
redundant expert slots (EPLB) holds some experts in several slots, and the model's
``slot_experts`` says which: a tensor is written into every local slot holding its
expert, and names of experts this process holds no slot of are skipped. The layout
reads the placement when built; :meth:`WeightLayout.stale` says when it moved.
A model may rename checkpoint names first (``checkpoint_renames``: Mixtral's
``block_sparse_moe.experts.E.w1``).

:class:`WeightStage` collects named tensors into targets. Built ``live=True`` it
writes straight into the model's tensors (the initial load); otherwise it
writes into new tensors beside the serving ones, so a session can be validated
and thrown away without the model ever seeing half of it:

- :meth:`WeightStage.add` checks the name and the shape of each tensor on arrival
  (an unknown name or a wrong shape raises ValueError naming it) and copies it
  into its rows of the staged target (the fusion happens here, by position).
- :meth:`WeightStage.prepare` runs once at the end: rows no tensor wrote are copied
  from the serving weights (a partial update), and every int8 layer whose weight
  changed is quantized and packed again from the staged fp32 values: once per
  session, not once per tensor. Nothing serving changes.
- :meth:`Prepared.commit` swaps the staged tensors in (parameter ``.data`` and
  int8 buffers: reference swaps, no copy) and returns the undo that swaps the old
  ones back. Run it between scheduler steps.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from radixray.engine.mem_cache.hugepages import advise_huge_pages, empty_huge
from radixray.kernels.int8_linear import Int8Linear

# Checkpoint tensors the model computes itself (rotary tables) or does not keep.
_SKIPPED_SUBSTRINGS = ("rotary_emb.",)
_INT8_BUFFERS = ("w_q_t", "w_vnni", "w_vnni_comp", "w_scale")


@dataclass(frozen=True)
class Shard:
    """Rows ``[offset, offset + shape[0])`` of ``target`` come from one checkpoint tensor; of
    ``target[index]`` when ``index`` is set (one expert of a stacked parameter), and the
    same rows of ``target[c]`` for each ``c`` in ``copies`` (that expert's other slots).
    ``gather``: the tensor stacks every logical expert and slot ``i`` of the target takes
    its row ``gather[i]`` (a stacked name when slots and experts differ)."""

    target: str
    offset: int
    shape: tuple[int, ...]
    index: int | None = None
    copies: tuple[int, ...] = ()
    gather: tuple[int, ...] | None = None

    def view(self, full: torch.Tensor) -> torch.Tensor:
        """The part of ``full`` (a tensor of the target's shape) this shard fills (its first
        copy)."""
        rows = full if self.index is None else full[self.index]
        return rows[self.offset:self.offset + self.shape[0]]

    def write(self, full: torch.Tensor, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into every place of ``full`` this shard fills."""
        if self.gather is not None:
            full.copy_(tensor[list(self.gather)])
            return
        self.view(full).copy_(tensor)
        self.replicate(full)

    def replicate(self, full: torch.Tensor) -> None:
        """Copy the first copy's rows into the other copies (after it was filled in place)."""
        for c in self.copies:
            full[c][self.offset:self.offset + self.shape[0]].copy_(self.view(full))


def split_rows(parts: tuple[tuple[str, int | None], ...], total: int) -> list[tuple[str, int]]:
    """``(name, rows)`` parts of a fused dimension of ``total`` rows; rows None is an equal
    share of what the counted parts leave."""
    free = [name for name, rows in parts if rows is None]
    share = (total - sum(rows for _, rows in parts if rows is not None)) // max(len(free), 1)
    return [(name, share if rows is None else rows) for name, rows in parts]


@dataclass
class Target:
    """One tensor of the model that checkpoint tensors fill.

    ``kind`` is ``param`` (an ``nn.Parameter``: ``owner.<attr>``) or ``int8`` (the
    weight or bias of an :class:`Int8Linear` ``owner``, kept in fp32 only while staged).
    """

    name: str
    kind: str
    owner: nn.Module
    attr: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    shards: list[str] = field(default_factory=list)

    def live(self) -> torch.Tensor | None:
        """The serving tensor (None for an int8 layer's weight: only its codes exist)."""
        if self.kind == "param":
            return getattr(self.owner, self.attr).data
        return self.owner.bias if self.attr == "bias" else None


class WeightLayout:
    """Checkpoint name -> :class:`Shard` for one model instance (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        fused: dict[str, tuple[tuple[str, int | None], ...]] = model.fused_shards()
        # owner leaf -> parameter leaf -> parts, for parameters stacked over experts (dim 0)
        self.stacked: dict[str, dict[str, tuple]] = getattr(model, "stacked_shards", dict)()
        self.renames = [(re.compile(p), r) for p, r in getattr(model, "checkpoint_renames", tuple)()]
        expert_map = getattr(model, "expert_map", None)
        self.placement_version = None if expert_map is None else expert_map.version
        self.targets: dict[str, Target] = {}
        self.shards: dict[str, Shard] = {}
        self.skipped: set[str] = set()  # experts held by no local slot (other EP ranks)
        # a name that fills a whole stacked target -> the per-expert shards it writes
        self.aliases: dict[str, tuple[str, ...]] = {}
        self.tied = bool(getattr(model, "tie_word_embeddings", False))
        seen: set[int] = set()
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            self._add_target(name, "param", owner, attr, param, fused)
        for path, module in model.named_modules():
            if isinstance(module, Int8Linear) and path != "lm_head_int8":
                weight_shape = (module.out_features, module.in_features)
                self._add_target(f"{path}.weight", "int8", module, "weight",
                                 torch.empty(weight_shape, device="meta"), fused)
                if module.bias is not None:
                    self._add_target(f"{path}.bias", "int8", module, "bias", module.bias, fused)
        self.lm_head_target = "embed_tokens.weight" if self.tied else "lm_head.weight"
        self.tp_shard = getattr(model, "tp_shard", None)  # tensor parallelism: its slice

    def splits(self, name: str) -> bool:
        """Whether this rank (tensor parallelism) keeps only a slice of tensor ``name``."""
        return self.tp_shard is not None and self.tp_shard.splits(self.canonical(name))

    def local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of checkpoint tensor ``name`` (engine/tp/sharding.py); the tensor
        itself without tensor parallelism or for a tensor every rank holds whole."""
        if not self.splits(name):
            return tensor
        shard = self.locate(name)
        return self.tp_shard.local(self.canonical(name), tensor,
                                   None if shard is None else shard.shape)

    def _add_target(self, name: str, kind: str, owner: nn.Module, attr: str, like: torch.Tensor,
                    fused: dict) -> None:
        shape = tuple(like.shape)
        dtype = like.dtype if kind == "param" else torch.float32
        device = like.device if like.device.type != "meta" else _module_device(owner)
        target = Target(name, kind, owner, attr, shape, dtype, device)
        self.targets[name] = target
        prefix, _, leaf = name.rpartition(".")
        parent, _, owner_leaf = prefix.rpartition(".")
        stacked = self.stacked.get(owner_leaf, {}).get(leaf) if kind == "param" else None
        if stacked is not None:
            # experts.<leaf> [slots, rows, cols] <- experts.<e>.<part>.weight [part rows, cols]
            # into every slot holding logical expert e
            slot_experts, num_logical = self._slot_experts(prefix, shape[0])
            for e in range(num_logical):
                slots = [i for i, x in enumerate(slot_experts) if x == e]
                name_format = f"{prefix}.{e}.{{}}.weight"
                if not slots:
                    self.skipped.update(name_format.format(p) for p, _ in stacked)
                    continue
                self._add_parts(target, stacked, shape[1:], name_format, slots[0],
                                tuple(slots[1:]))
            identity = slot_experts == list(range(num_logical))
            self.shards[name] = Shard(target.name, 0, (num_logical, *shape[1:]),
                                      gather=None if identity else tuple(slot_experts))
            self.aliases[name] = tuple(target.shards)
            return
        parts = fused.get(owner_leaf)
        if parts is None:
            self._add_shard(target, name, 0, shape)
            return
        self._add_parts(target, parts, shape, f"{parent}.{{}}.{leaf}", None)

    def _slot_experts(self, prefix: str, num_slots: int) -> tuple[list[int], int]:
        """(the logical expert of each slot of the stacked module ``prefix``, logical count)."""
        lookup = getattr(self.model, "slot_experts", None)
        return lookup(prefix) if lookup is not None else (list(range(num_slots)), num_slots)

    def _add_parts(self, target: Target, parts: tuple, shape: tuple[int, ...], name_format: str,
                   index: int | None, copies: tuple[int, ...] = ()) -> None:
        """One shard per fused part, named ``name_format.format(part)``, stacked along rows."""
        offset = 0
        for part, rows in split_rows(parts, shape[0]):
            self._add_shard(target, name_format.format(part), offset, (rows, *shape[1:]), index,
                            copies)
            offset += rows
        if offset != shape[0]:
            raise AssertionError(f"{target.name}: fused shards cover {offset} of {shape[0]} rows")

    def _add_shard(self, target: Target, name: str, offset: int, shape: tuple[int, ...],
                   index: int | None = None, copies: tuple[int, ...] = ()) -> None:
        self.shards[name] = Shard(target.name, offset, shape, index, copies)
        target.shards.append(name)

    def stale(self) -> bool:
        """Whether the model's experts moved since this layout was built (build a new one)."""
        expert_map = getattr(self.model, "expert_map", None)
        return expert_map is not None and expert_map.version != self.placement_version

    def canonical(self, name: str) -> str:
        """``name`` as the layout knows it: without ``model.``, the model's renames applied."""
        name = name.removeprefix("model.")
        for pattern, replacement in self.renames:
            name = pattern.sub(replacement, name)
        return name

    def locate(self, name: str) -> Shard | None:
        """The shard a checkpoint name fills; None for a name the model skips on purpose
        (rotary tables; ``lm_head.weight`` when tied to the embedding). KeyError names an
        unknown tensor."""
        name = self.canonical(name)
        shard = self.shards.get(name)
        if shard is not None:
            return shard
        if any(s in name for s in _SKIPPED_SUBSTRINGS) or (self.tied and name == "lm_head.weight") \
                or name in self.skipped:
            return None
        raise KeyError(name)


def _module_device(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        if t is not None:
            return t.device
    return torch.device("cpu")


class WeightStage:
    """New values for some or all of a model's targets; see the module docstring."""

    def __init__(self, layout: WeightLayout, live: bool = False, fault_huge_pages: bool = True):
        """``live``: write straight into the serving parameters (the initial load).
        ``fault_huge_pages``: advise new CPU tensors for huge pages before they are written
        (one fault per 2 MiB). False advises them after they are written instead: faulting
        huge pages makes the kernel compact memory first, which right after a colocated
        trainer's step took up to 2 s for 513 MiB here (4 KiB pages: 0.23 s); the advice
        given late lets khugepaged merge the pages in the background."""
        self.layout = layout
        self.live = live
        self.fault_huge_pages = fault_huge_pages
        # called with each checkpoint tensor staged, whole (a tensor-parallel driver relays it)
        self.on_add = None
        self.staged: dict[str, torch.Tensor] = {}  # target name -> tensor of the target's shape
        self.written: dict[str, set[str]] = {}  # target name -> shard names written
        self.tensors = 0
        self.bytes = 0

    def buffer_for(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The staged rows ``name`` fills, to receive a ``dtype`` tensor into directly (a
        collective's output); None when a temporary is needed (other dtype, skipped name).
        Validates the name like :meth:`add`. Call :meth:`mark_written` once filled."""
        shard = self.shard(name)
        if shard is None:
            return None
        target = self.layout.targets[shard.target]
        if target.dtype != dtype or shard.gather is not None or self.layout.splits(name):
            return None
        return shard.view(self._full(target))

    def mark_written(self, name: str) -> None:
        """``name``'s rows hold its new values (after filling :meth:`buffer_for`); its expert's
        other slots take them too."""
        shard = self.shard(name)
        if shard is not None:
            full = self._full(self.layout.targets[shard.target])
            shard.replicate(full)
            self._note(shard, name)
            if self.on_add is not None:
                self.on_add(name, shard.view(full))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into the rows ``name`` fills (dtype converted). ValueError names an
        unknown name or a shape that differs from the model's."""
        shard = self.shard(name)
        if shard is None:
            return
        whole, tensor = tensor, self.layout.local(name, tensor)
        if tuple(tensor.shape) != shard.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}; the model expects "
                             f"{shard.shape}")
        shard.write(self._full(self.layout.targets[shard.target]), tensor)
        self._note(shard, name)
        if self.on_add is not None:
            self.on_add(name, whole)

    def add_all(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            self.add(name, tensor)

    def check_shape(self, name: str, shape) -> None:
        """ValueError naming tensor ``name`` unless :meth:`add` would take a ``shape`` tensor
        of that name (checked before a broadcast is received)."""
        shard = self.shard(name)
        local = self.layout.local(name, torch.empty(tuple(shape), device="meta"))
        if shard is not None and tuple(shard.shape) != tuple(local.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(shape)}; the model expects "
                             f"{shard.shape}")

    def shard(self, name: str) -> Shard | None:
        """The shard ``name`` fills (None: skipped on purpose); ValueError for an unknown name."""
        try:
            return self.layout.locate(name)
        except KeyError:
            raise ValueError(f"tensor {name!r} has no matching parameter in the model "
                             f"(expected Hugging Face names such as "
                             f"{next(iter(self.layout.shards))!r})") from None

    def _note(self, shard: Shard, name: str) -> None:
        name = self.layout.canonical(name)
        self.written.setdefault(shard.target, set()).update(self.layout.aliases.get(name, (name,)))
        self.tensors += 1
        numel = 1
        for d in shard.shape:
            numel *= d
        self.bytes += numel * self.layout.targets[shard.target].dtype.itemsize

    def _full(self, target: Target) -> torch.Tensor:
        """The staged tensor of ``target`` (the serving one when ``live``), made on first use."""
        full = self.staged.get(target.name)
        if full is None:
            if self.live and target.kind == "param":
                full = target.live()
            elif target.device.type == "cpu" and self.fault_huge_pages:
                full = empty_huge(target.shape, target.dtype)
            else:
                full = torch.empty(target.shape, dtype=target.dtype, device=target.device)
            self.staged[target.name] = full
        return full

    def missing(self) -> list[str]:
        """Checkpoint names of every shard not written yet (all targets)."""
        return [s for t in self.layout.targets.values() for s in t.shards
                if s not in self.written.get(t.name, ())]

    def check_complete(self) -> None:
        """ValueError unless every shard was written (a full checkpoint)."""
        missing = self.missing()
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def prepare(self) -> Prepared:
        """Finish the staged targets without touching the serving ones: copy unwritten rows
        from the serving weights, quantize int8 layers once. ValueError when nothing was
        staged, or when an int8 layer's weight came in part (its fp32 rows are gone)."""
        if not self.written:
            raise ValueError("no tensors were staged in this weight update session")
        for name in self.written:
            target = self.layout.targets[name]
            missing = [s for s in target.shards if s not in self.written[name]]
            if not missing:
                continue
            live = target.live()
            if live is None:
                raise ValueError(f"{name} is int8-quantized, so its shards "
                                 f"{target.shards} must all come in one session; missing {missing}")
            for shard_name in missing:
                shard = self.layout.shards[shard_name]
                shard.view(self.staged[name]).copy_(shard.view(live))
                shard.replicate(self.staged[name])
        if not self.fault_huge_pages:
            for tensor in self.staged.values():
                advise_huge_pages(tensor)
        return Prepared(self)


class Prepared:
    """A staged update ready to go live: the new tensor for each target, int8 layers packed."""

    def __init__(self, stage: WeightStage):
        layout = stage.layout
        self.params: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.int8: list[tuple[Int8Linear, dict[str, torch.Tensor | None]]] = []
        int8_layers: dict[int, tuple[Int8Linear, dict]] = {}
        for name, tensor in stage.staged.items():
            target = layout.targets[name]
            if target.kind == "param":
                self.params.append((getattr(target.owner, target.attr), tensor))
            else:
                int8_layers.setdefault(id(target.owner), (target.owner, {}))[1][target.attr] = tensor
        for module, new in int8_layers.values():
            self.int8.append((module, _int8_buffers(module, new.get("weight"), new.get("bias"))))
        head = getattr(layout.model, "lm_head_int8", None)
        if isinstance(head, Int8Linear) and layout.lm_head_target in stage.staged:
            self.int8.append((head, _int8_buffers(head, stage.staged[layout.lm_head_target], None)))
        self.tensors, self.bytes = stage.tensors, stage.bytes

    def commit(self) -> Undo:
        """Swap the new tensors in (references only) and return how to swap the old back."""
        undo = Undo([(p, p.data) for p, _ in self.params],
                    [(m, {k: getattr(m, k) for k in new}) for m, new in self.int8])
        for param, tensor in self.params:
            param.data = tensor
        for module, new in self.int8:
            _set_buffers(module, new)
        return undo


@dataclass
class Undo:
    """The tensors a commit replaced; :meth:`rollback` puts them back."""

    params: list[tuple[nn.Parameter, torch.Tensor]]
    int8: list[tuple[Int8Linear, dict[str, torch.Tensor | None]]]

    def rollback(self) -> None:
        for param, tensor in self.params:
            param.data = tensor
        for module, old in self.int8:
            _set_buffers(module, old)


def _int8_buffers(module: Int8Linear, weight: torch.Tensor | None,
                  bias: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """The buffers ``module`` would hold for a new fp32 ``weight`` (None: keep its codes) and
    ``bias`` (None: keep its bias), packed as its constructor packs them."""
    new: dict[str, torch.Tensor | None] = {}
    if weight is not None:
        fresh = Int8Linear(weight, None, fused_ops=module.ext is not None)
        new.update({k: getattr(fresh, k) for k in _INT8_BUFFERS})
    if bias is not None:
        new["bias"] = bias.float()
    return new


def _set_buffers(module: Int8Linear, values: dict[str, torch.Tensor | None]) -> None:
    for key, value in values.items():
        setattr(module, key, value)
