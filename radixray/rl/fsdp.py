"""One rank of a sharded trainer: :class:`~radixray.rl.trainer.PolicyTrainer` under FSDP2.

:class:`FSDPRank` is a :class:`PolicyTrainer` (same model, loss, micro-batches, scorer and
weight-out methods) whose model is sharded with torch's FSDP2 (``fully_shard``): every
decoder layer (the model's ``_no_split_modules`` classes) is one unit, the root (embedding,
final norm, head) another. Each rank holds 1/N of every parameter, its gradient and its
AdamW moments. A forward all-gathers a unit's parameters just before it runs and frees
them after; a backward reduce-scatters the unit's gradients, summed over the ranks (not
averaged: every rank divides its loss by the step's GLOBAL masked-token count, so the sum
is the one-process gradient). ``clip_grad_norm_`` over the sharded (DTensor) gradients
takes the global norm; AdamW steps the shards.

Collectives in order: FSDP2 matches each rank's all-gathers and reduce-scatters by their
order, so every rank runs the same number of micro-batches per step (a rank with fewer
samples, or none, runs :meth:`FSDPRank._idle_pass` es: a one-token forward and a zero
backward), and every weight-out call (:meth:`named_weights` and the methods built on it)
is made on every rank together (:class:`~radixray.rl.trainer_group.TrainerGroup` does).

Backends: NCCL on CUDA, gloo on CPU. gloo in torch 2.13 has every collective FSDP2 uses
(``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``: tried on this
torch), but not ``ReduceOp.PREMUL_SUM``, which FSDP2 picks for a custom gradient divide
factor; the ranks therefore ask for plain sums (``set_force_sum_reduction_for_comms``,
divide factor 1), which both backends have. So CPU and GPU run the same FSDP2 code.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import torch

from radixray.rl.trainer import PolicyTrainer, trained_tokens

logger = logging.getLogger("radixray.rl")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that are one FSDP unit each: those whose class Hugging Face
    names in ``_no_split_modules`` (the decoder layers), outermost first."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    # by class name, also once fully_shard has made the class FSDP<Name>, a subclass
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def shard_model(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root, over ``mesh``; gradients are
    reduced as plain sums (see the module docstring). Returns the (same) model."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def pin_gloo_interface(node_ip: str) -> None:
    """Make gloo listen on the interface that holds ``node_ip`` (this Ray node's address:
    the one the other ranks reach), unless GLOO_SOCKET_IFNAME is set already."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        import psutil
    except ImportError:  # gloo falls back to the hostname's address
        return
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == node_ip for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def split_evenly(samples: list, parts: int) -> list[list]:
    """``samples`` cut into ``parts`` contiguous runs whose lengths differ by at most one,
    the longer ones first (a run may be empty)."""
    size, extra = divmod(len(samples), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(samples[start:end])
        start = end
    return out


class FSDPRank(PolicyTrainer):
    """Rank ``rank`` of ``world_size``: joins the group at ``init_method`` (``tcp://host:port``,
    rank 0 listens), then builds the :class:`PolicyTrainer` with the model sharded. The
    other arguments are PolicyTrainer's; ``num_threads`` defaults to this process's cores
    divided among the ranks (they may share a node)."""

    def __init__(self, rank: int, world_size: int, init_method: str, model_path: str,
                 options: dict, device: str = "cpu", seed: int = 0,
                 num_threads: int | None = None, deterministic: bool = False,
                 timeout_s: float = 600.0):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        self.rank, self.world_size = rank, world_size
        cuda = device.startswith("cuda")
        if cuda and device == "cuda" and torch.cuda.device_count() > 1:
            device = f"cuda:{rank % torch.cuda.device_count()}"  # ranks sharing a node's GPUs
        if cuda:
            torch.cuda.set_device(torch.device(device))
        else:
            import ray
            if ray.is_initialized():  # a Ray actor: listen where Ray reaches this node
                pin_gloo_interface(ray.util.get_node_ip_address())
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.mesh = init_device_mesh("cuda" if cuda else "cpu", (world_size,))
        self._gathered: dict[str, torch.Tensor] | None = None
        threads = num_threads or max(1, len(os.sched_getaffinity(0)) // world_size)
        super().__init__(model_path, options, device, seed, threads, deterministic)
        logger.info("trainer rank %d of %d ready (%s, FSDP2 over %d decoder layers)", rank,
                    world_size, backend, len(decoder_layers(self.model)))

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        return shard_model(model, self.mesh)

    def _counts(self, samples: list[dict]) -> tuple[int, int]:
        """(the step's masked tokens over every rank, the most micro-batches any rank has)."""
        import torch.distributed as dist
        mb = self.options["micro_batch_size"]
        device = self.device if self.device.type == "cuda" else "cpu"
        sums = torch.tensor([trained_tokens(samples)], dtype=torch.long, device=device)
        most = torch.tensor([-(-len(samples) // mb)], dtype=torch.long, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(sums.item()), int(most.item())

    def train_part(self, samples: list[dict]) -> dict:
        """This rank's share of one optimizer step over its ``samples`` (every rank calls it
        at once): the part :func:`~radixray.rl.trainer.step_stats` merges, with the global
        ``tokens`` and ``grad_norm`` (equal on every rank) and this rank's ``train_s``."""
        t0 = time.perf_counter()
        total, micro_batches = self._counts(samples)
        part = self._accumulate(samples, total, micro_batches)
        part["grad_norm"] = self._clip_and_step()
        part["tokens"] = total
        part["train_s"] = time.perf_counter() - t0
        return part

    def train_step(self, samples: list[dict]) -> dict:
        raise TypeError("a sharded trainer's rank trains through TrainerGroup.train_step "
                        "(every rank at once); call train_part on each rank")

    def _idle_pass(self) -> None:
        """A one-token forward (and the reference's, as a real micro-batch runs it) and a
        backward of zero: the all-gathers and reduce-scatters the other ranks' micro-batch
        makes, with no change to the gradients."""
        tokens = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        logits = self.model(input_ids=tokens).logits
        if self.ref is not None:
            with torch.no_grad():
                self.ref(input_ids=tokens)
        (logits.sum() * 0.0).backward()

    def _clip_and_step(self) -> float:
        self._gathered = None
        return super()._clip_and_step()

    # ---- weights out: gathered on every rank, used by rank 0 ----------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The full parameters under their Hugging Face names (a collective: every rank
        calls it together; kept until the next optimizer step, so calling it again gathers
        nothing)."""
        if self._gathered is None:
            self._gathered = {name: p.detach().full_tensor()
                              for name, p in self.model.named_parameters()}
        return self._gathered

    def _on_rank0(self, method, *args):
        """Rank 0 runs ``method``; the other ranks take part in its gather only."""
        if self.rank == 0:
            return method(*args)
        self.named_weights()
        return None

    def write_shared(self, directory: str = "/dev/shm"):
        return self._on_rank0(super().write_shared, directory)

    def put_payload(self):
        return self._on_rank0(super().put_payload)

    def weight_spec(self):
        return self._on_rank0(super().weight_spec)

    def broadcast(self) -> int:
        return self._on_rank0(super().broadcast)

    def close(self) -> None:
        import torch.distributed as dist
        super().close()
        self._gathered = None
        if dist.is_initialized():
            dist.destroy_process_group()
