"""LoRA adapter slots: the loaded adapters (host cache) and ``max_loras_per_batch`` slots of
stacked A/B weights on the model's device that forward passes read.

Every loaded adapter stays in host memory (peft_adapter.py). A batch's adapters are copied
into slots on demand (:meth:`LoraSlots.prepare`); a slot whose adapter no batch and no
running request uses is reused least recently used first. The scheduler's admission keeps
the distinct adapters of the running requests and a new batch within the slot count, so a
slot is always found. Scheduler thread only, except :meth:`namespace` and
:meth:`adapters` (reads of one dict, safe from any thread).

Per decoder layer a projection is one LoRA target; a fused projection stacks its parts'
ranks: ``qkv`` takes A ``[q|k|v ranks, hidden]`` and a block-diagonal B ``[q+2kv, 3R]``,
``gate_up`` likewise with two parts, ``o`` and ``down`` one each. Ranks below the slots'
rank ``R`` are zero-padded, so an adapter's update is exact whatever its rank. The
adapter-wide scaling goes to the kernel (kernels/lora.py); a module whose PEFT rank or
alpha pattern scales it otherwise has the ratio folded into its B.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixray.engine.weights.lora_options import (
    DEFAULT_MAX_LORA_RANK,
    check_adapter_name,
    parse_lora_path,
)
from radixray.engine.weights.peft_adapter import LoraAdapter, read_peft_adapter
from radixray.engine.weights.version import (
    WeightVersion,
    check_version,
    default_version,
    raise_floor,
)
from radixray.kernels.int8_linear import Int8Linear, quantize_per_channel
from radixray.kernels.lora import (
    MIN_INT8_ROWS,
    Int8Shrink,
    LoraRows,
    LoraSegments,
    lora_add,
    lora_add_segments,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraTarget:
    """One (fused) projection: the PEFT modules stacked in it, its input width and each
    part's output rows."""

    modules: tuple[str, ...]
    in_features: int
    out_parts: tuple[int, ...]


def lora_targets(model) -> dict[str, LoraTarget]:
    """The LoRA targets of a dense Llama-family model (``models/llama.py``: its MLPs have
    ``forward_lora``). ValueError for a model whose feed-forward blocks are not dense
    (mixture of experts)."""
    if not all(hasattr(layer.mlp, "forward_lora") for layer in model.layers):
        raise ValueError("LoRA serves dense Llama-family models (Llama, Mistral, Qwen2, "
                         "Qwen3); this model has mixture-of-experts layers")
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    hidden = model.config.hidden_size
    return {"qkv": LoraTarget(("q_proj", "k_proj", "v_proj"), hidden,
                              (attn.q_size, attn.kv_size, attn.kv_size)),
            "o": LoraTarget(("o_proj",), attn.q_size, (hidden,)),
            "gate_up": LoraTarget(("gate_proj", "up_proj"), hidden, (mlp.inter, mlp.inter)),
            "down": LoraTarget(("down_proj",), mlp.inter, (hidden,))}


def _target_layers(model) -> list[torch.nn.Module]:
    """The base projection layers of every LoRA target, all decoder layers."""
    return [proj for layer in model.layers
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]


class LoraBatch:
    """The adapters of one forward pass: each row's slot (-1: none) and the slots' weights.
    The model runs each LoRA target's base projection through :meth:`project`.

    A decode batch on the CPU (``decode``) runs one op per target (kernels/lora.py
    ``lora_add_segments``) over its rows planned by slot here, once: no Python per adapter
    in the forward, so a compiled decode step runs it (``traceable``). Other batches run
    their rows by slot (``lora_add``), or triton's segmented kernels on CUDA. The scheduler
    keeps its running requests ordered by :meth:`LoraSlots.slot_index`, so each adapter's
    decode rows are consecutive."""

    def __init__(self, slots: LoraSlots, row_slots: torch.Tensor, decode: bool = False):
        self.slots = slots
        self.row_slots = row_slots
        self._rows = None  # LoraRows (torch) or the segments (triton), once per batch
        self.segments = (LoraSegments.of(row_slots, slots.scalings, slots.dtype)
                         if decode and slots.kernel == "torch" else None)

    @property
    def traceable(self) -> bool:
        """Whether :meth:`apply` runs the one-op form torch.compile keeps whole."""
        return self.segments is not None

    def to(self, device: str) -> None:
        self.row_slots = self.row_slots.to(device, non_blocking=True)
        self._rows = None

    def project(self, target: str, layer: int, proj: torch.nn.Module, x: torch.Tensor,
                kernels) -> torch.Tensor:
        """``proj(x)`` (by ``kernels``, a CpuKernels) plus each row's adapter update. In an
        int8 engine (``LoraSlots.int8_shrink``) outside the compiled decode op, a batch with
        room for a run of ``MIN_INT8_ROWS`` rows quantizes ``x`` once: the base projection
        and those runs' shrinks share its codes."""
        if (self.slots.int8_shrink and self.segments is None and x.shape[0] >= MIN_INT8_ROWS
                and x.dtype == torch.float32 and not x.is_cuda):
            x_q, x_scale = proj.ext.quantize_rows_int8(x)
            a_q, a_scale = self.slots.int8_weights(target, layer)
            return self.apply(target, layer, proj.from_codes(x_q, x_scale), x,
                              Int8Shrink(x_q, x_scale, a_q, a_scale))
        return self.apply(target, layer, kernels.project(x, proj), x)

    def apply(self, target: str, layer: int, base: torch.Tensor, x: torch.Tensor,
              int8: Int8Shrink | None = None) -> torch.Tensor:
        """``base`` (the projection of ``x`` ``[T, in]``) plus each row's adapter update, in
        place; ``int8``: the long runs' shrinks on codes (kernels/lora.py)."""
        a, b = self.slots.weights(target, layer)
        if self.segments is not None:
            return lora_add_segments(base, x, a, b, self.segments)
        if self.slots.kernel == "triton":
            from radixray.kernels.triton_lora import lora_add_triton, lora_segments
            if self._rows is None:
                self._rows = lora_segments(self.row_slots)
            return lora_add_triton(base, x, a, b, self.slots.device_scalings(), self._rows)
        if self._rows is None:
            self._rows = LoraRows.of(self.row_slots)
        return lora_add(base, x, a, b, self.slots.scalings, self._rows,
                        self.slots.targets[target].out_parts, int8)


class LoraSlots:
    """Loaded adapters and the device slots; see the module docstring."""

    def __init__(self, model, num_slots: int, max_rank: int, dtype: torch.dtype, device: str):
        self.targets = lora_targets(model)
        self.num_layers = len(model.layers)
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, device
        # per target: A [layers, slots, parts*R, in], B [layers, slots, out, parts*R]
        self.a, self.b = {}, {}
        for name, t in self.targets.items():
            width = len(t.modules) * max_rank
            self.a[name] = torch.zeros(self.num_layers, num_slots, width, t.in_features,
                                       dtype=dtype, device=device)
            self.b[name] = torch.zeros(self.num_layers, num_slots, sum(t.out_parts), width,
                                       dtype=dtype, device=device)
        self.scalings = torch.zeros(num_slots, dtype=torch.float32)
        self._device_scalings: torch.Tensor | None = None
        # the batched matmul: triton's segmented kernels on CUDA, grouped torch GEMMs on the CPU
        self.kernel = "triton" if str(device).startswith("cuda") else "torch"
        # An int8 engine (every target's base layer w8a8 int8 with the C++ kernels) also keeps
        # A's codes: prefill runs shrink on the activations' codes (kernels/lora.py Int8Shrink).
        self.int8_shrink = self.kernel == "torch" and all(
            isinstance(layer, Int8Linear) and layer.ext is not None
            for layer in _target_layers(model))
        self.a_q, self.a_scale = {}, {}  # per target: [layers, slots, width, in] / [..., width]
        if self.int8_shrink:
            for name, a in self.a.items():
                self.a_q[name] = torch.zeros(a.shape, dtype=torch.int8, device=device)
                self.a_scale[name] = torch.ones(a.shape[:-1], dtype=torch.float32, device=device)
        self._adapters: dict[str, tuple[LoraAdapter, int]] = {}  # name -> (adapter, namespace)
        self.versions: dict[str, WeightVersion] = {}  # name -> the version serving (0 at load)
        self._floors: dict[str, int] = {}  # name -> the greatest int version it served
        self._namespaces = itertools.count(1)
        self.slot_names: list[str | None] = [None] * num_slots
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self.loads = 0  # adapters copied into a slot (a reuse costs none)
        # adapters the running requests use (set by the scheduler): never evicted
        self.pinned: Callable[[], set[str]] = set

    # ---- the host cache (any thread may read) ---------------------------------------------
    def namespace(self, name: str) -> int | None:
        """The radix-cache namespace of loaded adapter ``name`` (an int never reused, so a
        reloaded adapter never shares the KV of its earlier weights), or None."""
        entry = self._adapters.get(name)
        return entry[1] if entry is not None else None

    def version(self, name: str) -> WeightVersion:
        """The version of adapter ``name`` serving now (0 when loaded, then each update's)."""
        return self.versions.get(name, 0)

    def floor(self, name: str) -> int:
        """The greatest int version adapter ``name`` served (its versions' floor)."""
        return self._floors.get(name, 0)

    def adapters(self) -> dict[str, str]:
        """Loaded adapter name -> its path."""
        return {name: a.path for name, (a, _) in list(self._adapters.items())}

    def adapter(self, name: str) -> LoraAdapter:
        """Loaded adapter ``name`` (KeyError if not loaded)."""
        return self._adapters[name][0]

    def check(self, adapter: LoraAdapter, replacing: bool = False) -> None:
        """ValueError naming the adapter when it does not fit: a taken name (unless
        ``replacing`` it), a rank above the slots', or a shape other than the model's."""
        if adapter.name in self._adapters and not replacing:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded: unload it first")
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above "
                             f"max_lora_rank={self.max_rank}")
        for (layer, module), (a, b) in adapter.weights.items():
            target = next(t for t in self.targets.values() if module in t.modules)
            out = target.out_parts[target.modules.index(module)]
            if a.shape[1] != target.in_features or b.shape[0] != out:
                raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} is "
                                 f"[{b.shape[0]} x {a.shape[1]}], the model's is "
                                 f"[{out} x {target.in_features}]")

    # ---- scheduler thread ------------------------------------------------------------------
    def register(self, adapter: LoraAdapter) -> int:
        """Add a read adapter to the host cache; returns its namespace (ValueError: :meth:`check`)."""
        self.check(adapter)
        ns = next(self._namespaces)
        self._adapters[adapter.name] = (adapter, ns)
        self.versions[adapter.name], self._floors[adapter.name] = 0, 0
        logger.info("LoRA adapter %s loaded from %s: rank %d, modules %s", adapter.name,
                    adapter.path, adapter.rank, ",".join(adapter.modules))
        return ns

    def unregister(self, name: str) -> None:
        """Drop adapter ``name`` and its slot (KeyError if not loaded)."""
        del self._adapters[name]
        self.versions.pop(name, None)
        self._floors.pop(name, None)
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self.slot_names[slot] = None
        logger.info("LoRA adapter %s unloaded", name)

    def check_version(self, name: str, version: WeightVersion | None) -> WeightVersion:
        """The version an update of ``name`` takes (None: the next int); VersionRefused as
        for the base weights (engine/weights/version.py), against this adapter's own floor."""
        floor = self._floors.get(name, 0)
        if version is None:
            return default_version(floor)
        return check_version(version, floor, f"the greatest integer version adapter {name!r} "
                             "served so far")

    def replace(self, adapter: LoraAdapter, version: WeightVersion, held: list,
                floor: int | None = None) -> int:
        """Scheduler thread: serve ``adapter``'s new weights under its name from the next
        step on, as ``version``. Its radix-cache namespace is new (KV of the old weights is
        never matched again); a slot holding it is refilled; the ``held`` requests running
        with it are stamped with the new version. Its floor rises to ``version``, or is set
        to ``floor`` (a rollback's). Returns how many requests those were."""
        ns = next(self._namespaces)
        self._adapters[adapter.name] = (adapter, ns)
        self.versions[adapter.name] = version
        self._floors[adapter.name] = (raise_floor(self._floors.get(adapter.name, 0), version)
                                      if floor is None else floor)
        if adapter.name in self.slot_names:
            self._fill(self.slot_names.index(adapter.name), adapter)
        users = [r for r in held if r.lora == adapter.name]
        for req in users:
            req.lora_version = version
        logger.info("LoRA adapter %s %s version %r (%d running requests)", adapter.name,
                    "updated to" if floor is None else "rolled back to", version, len(users))
        return len(users)

    def slot_index(self, name: str | None) -> int:
        """The slot holding adapter ``name``: -1 for none (the base model), ``num_slots``
        when it is in no slot. What the scheduler orders its running requests by."""
        if name is None:
            return -1
        return self.slot_names.index(name) if name in self.slot_names else self.num_slots

    def resident(self) -> list[str]:
        """The adapters in the device slots now, least recently used first (any thread: a
        read while a batch prepares may be one step old)."""
        held = [(self._last_used[s], n) for s, n in enumerate(self.slot_names) if n is not None]
        return [n for _, n in sorted(held)]

    def prepare(self, names: set[str]) -> dict[str, int]:
        """A slot for each adapter of ``names`` (copied in where missing); returns name -> slot.
        RuntimeError when more adapters are needed than slots are free of running ones (the
        scheduler's admission prevents it)."""
        if len(names) > self.num_slots:
            raise RuntimeError(f"{len(names)} LoRA adapters in one batch; max_loras_per_batch="
                               f"{self.num_slots}")
        now = next(self._clock)
        out = {}
        missing = []
        for name in names:
            if name in self.slot_names:
                out[name] = self.slot_names.index(name)
                self._last_used[out[name]] = now
            else:
                missing.append(name)
        if missing:
            keep = set(names) | self.pinned()
            free = sorted((s for s, n in enumerate(self.slot_names) if n is None or n not in keep),
                          key=lambda s: (self.slot_names[s] is not None, self._last_used[s]))
            if len(free) < len(missing):
                raise RuntimeError(f"no free LoRA slot for {missing}: every one of "
                                   f"max_loras_per_batch={self.num_slots} slots is in use")
            for name, slot in zip(missing, free):
                self._fill(slot, self._adapters[name][0])
                self._last_used[slot] = now
                out[name] = slot
        return out

    def batch(self, row_adapters: list[tuple[str | None, int]],
              decode: bool = False) -> LoraBatch | None:
        """The LoraBatch of a forward pass whose requests, in order, use ``(adapter or None,
        rows)`` (one row each: ``decode``); None when none uses an adapter."""
        names = {name for name, _ in row_adapters if name is not None}
        if not names:
            return None
        slot_of = self.prepare(names)
        row_slots = torch.cat([torch.full((n,), slot_of[name] if name is not None else -1,
                                          dtype=torch.int64) for name, n in row_adapters])
        return LoraBatch(self, row_slots, decode)

    def weights(self, target: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a[target][layer], self.b[target][layer]

    def int8_weights(self, target: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A's codes ``[slots, width, in]`` and per-row scales ``[slots, width]`` (int8 engines)."""
        return self.a_q[target][layer], self.a_scale[target][layer]

    def device_scalings(self) -> torch.Tensor:
        """The slots' scalings on the weights' device (copied again after a slot fill)."""
        if self._device_scalings is None:
            self._device_scalings = self.scalings.to(self.device)
        return self._device_scalings

    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (zeros where it has no weights or a lower rank)."""
        scale = Counter(adapter.scalings.values()).most_common(1)[0][0]
        r_max = self.max_rank
        for name, t in self.targets.items():
            a, b = self.a[name][:, slot], self.b[name][:, slot]
            a.zero_()
            b.zero_()
            for part, module in enumerate(t.modules):
                row0 = sum(t.out_parts[:part])
                rows = slice(row0, row0 + t.out_parts[part])
                for layer in range(self.num_layers):
                    pair = adapter.weights.get((layer, module))
                    if pair is None:
                        continue
                    la, lb = pair
                    r = la.shape[0]
                    ratio = adapter.scalings[(layer, module)] / scale
                    cols = slice(part * r_max, part * r_max + r)
                    a[layer, cols] = la.to(self.dtype)
                    b[layer, rows, cols] = (lb * ratio if ratio != 1.0 else lb).to(self.dtype)
            if self.int8_shrink:  # A's codes, per row of each layer's [width, in]
                codes, scales = quantize_per_channel(a.reshape(-1, t.in_features))
                self.a_q[name][:, slot] = codes.view(a.shape)
                self.a_scale[name][:, slot] = scales.view(a.shape[:-1])
        self.scalings[slot] = scale
        self._device_scalings = None
        self.slot_names[slot] = adapter.name
        self.loads += 1


def make_lora_slots(config, model, dtype: torch.dtype, device: str) -> LoraSlots | None:
    """The engine's LoraSlots with ``lora_paths``' adapters loaded, or None without LoRA. The
    slots' rank is ``max_lora_rank``, else the largest of those adapters' (16 without any);
    the choice is logged."""
    if not config.lora_enabled:
        return None
    adapters = [read_peft_adapter(name, path, len(model.layers))
                for name, path in map(parse_lora_path, config.lora_paths or ())]
    rank = config.max_lora_rank or max((a.rank for a in adapters), default=DEFAULT_MAX_LORA_RANK)
    slots = LoraSlots(model, config.max_loras_per_batch, rank, dtype, device)
    for adapter in adapters:
        slots.register(adapter)
    logger.info("LoRA: %d adapter slots (max_loras_per_batch) of rank %d (%s), %d adapters "
                "loaded, %s batched matmul", slots.num_slots, rank,
                "max_lora_rank" if config.max_lora_rank else
                "the largest loaded adapter's" if adapters else "the default", len(adapters),
                slots.kernel)
    return slots


def read_adapter_for(slots: LoraSlots | None, name: str, path: str) -> LoraAdapter:
    """Read adapter ``name`` from ``path`` for ``slots`` and check it fits (any thread; it
    changes nothing). ValueError naming the field or the adapter otherwise."""
    check_adapter_name(name, "lora_name")
    if slots is None:
        raise ValueError("load_lora_adapter: LoRA is off on this engine (start it with "
                         "enable_lora or lora_paths)")
    if not isinstance(path, str) or not path:
        raise ValueError("lora_path must be the adapter's folder")
    adapter = read_peft_adapter(name, path, slots.num_layers)
    slots.check(adapter)
    return adapter


def register_adapter(slots: LoraSlots, adapter: LoraAdapter) -> dict:
    """Scheduler thread: serve ``adapter`` (read by :func:`read_adapter_for`); the load
    verb's answer."""
    slots.register(adapter)
    return {"lora_name": adapter.name, "lora_path": adapter.path, "rank": adapter.rank,
            "loaded_adapters": slots.adapters()}


def unknown_adapter(call: str, slots: LoraSlots | None, name: str) -> ValueError:
    """The error of verb ``call`` for an adapter ``name`` this engine does not serve."""
    return ValueError(f"{call}: unknown LoRA adapter {name!r}; loaded adapters: "
                      f"{sorted(slots.adapters()) if slots else []}")


def unload_adapter(slots: LoraSlots | None, held: list, name: str) -> dict:
    """Scheduler thread: drop adapter ``name``; the unload verb's answer. ValueError naming
    it when it is not loaded or when requests ``held`` by the scheduler still use it
    (nothing changes then)."""
    if slots is None or slots.namespace(name) is None:
        raise unknown_adapter("unload_lora_adapter", slots, name)
    users = sum(1 for r in held if r.lora == name)
    if users:
        raise ValueError(f"unload_lora_adapter: LoRA adapter {name!r} is in use by {users} "
                         "request(s); unload it once they finish")
    slots.unregister(name)
    return {"lora_name": name, "loaded_adapters": slots.adapters()}
