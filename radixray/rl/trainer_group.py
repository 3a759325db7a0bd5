"""A sharded trainer: N :class:`~radixray.rl.fsdp.FSDPRank` Ray actors training as one.

:class:`TrainerGroup` offers :class:`~radixray.rl.trainer.PolicyTrainer`'s calls, so a GRPO
job uses either the same way (``trainer_ranks`` in the config picks; as a Ray actor through
:func:`trainer_group_actor_class`, or in-process). It starts one rank actor per entry of
``rank_options`` (each the actor options of one bundle of the job's placement group,
:meth:`~radixray.rl.placement.JobPlacement.trainer`); rank 0 is the rendezvous: a port
free on rank 0's bundle's node, found by a zero-CPU task there. The ranks join a
torch.distributed group (gloo on CPU, NCCL on CUDA) and shard the model with FSDP2
(:mod:`radixray.rl.fsdp` says what runs where, and what gloo lacks).

Training is data-parallel: :meth:`TrainerGroup.train_step` cuts the step's samples into
contiguous runs, as even as possible (a rank may get none), and hands each rank its run
untouched (the sample dicts keep whatever keys they carry). The ranks divide the loss by
the step's global masked-token count, sum the gradients and clip by the global norm, so a
step equals the one-process step up to float rounding. The statistics are
PolicyTrainer.train_step's, merged over the ranks (:func:`~radixray.rl.trainer.step_stats`:
losses summed, token-weighted means, maxima; ``train_s`` the slowest rank's).

Weights out: each weight call (:meth:`write_shared`, :meth:`put_payload`,
:meth:`weight_spec`, :meth:`broadcast`, :meth:`named_weights`) runs on every rank together,
since gathering the full weights (``DTensor.full_tensor`` per parameter) is a collective;
rank 0 then does what a single trainer does (shared-memory file, object store, or the
weight-update group's broadcast, as its rank 0). The full weights are gathered on rank 0
and sent from there, not scattered to the fleet's tensor-parallel ranks (those take their
slices of the full tensors, as from a single trainer). :meth:`broadcast_address`,
:meth:`open_broadcast` and :meth:`attach_fault_injector` concern rank 0 alone.

Deterministic mode works as with one trainer: each rank's scorer loads the gathered full
weights (the very tensors the fleet gets) and scores its own samples, so rollout and train
logprobs stay equal to the bit.
"""

from __future__ import annotations

import logging

from radixray.rl.fsdp import split_evenly
from radixray.rl.trainer import step_stats

logger = logging.getLogger("radixray.rl")


def _rendezvous() -> str:
    """``tcp://host:port``: this node's Ray address and a port free there now."""
    import ray

    from radixray.engine.ep.group import free_tcp_address
    return free_tcp_address(ray.util.get_node_ip_address())


class TrainerGroup:
    """``len(rank_options)`` FSDP ranks; the other arguments are PolicyTrainer's (see the
    module docstring)."""

    def __init__(self, rank_options: list[dict], model_path: str, options: dict,
                 device: str = "cpu", seed: int = 0, num_threads: int | None = None,
                 deterministic: bool = False):
        import ray

        from radixray.rl.fsdp import FSDPRank
        if not rank_options:
            raise ValueError("a trainer group needs at least one rank")
        self.world_size = len(rank_options)
        self.options = options
        where = {k: v for k, v in rank_options[0].items() if k == "scheduling_strategy"}
        init_method = ray.get(ray.remote(_rendezvous).options(num_cpus=0, **where).remote())
        rank_class = ray.remote(FSDPRank)
        self.ranks = []
        for rank, opts in enumerate(rank_options):
            self.ranks.append(rank_class.options(**opts).remote(
                rank, self.world_size, init_method, model_path, options, device, seed,
                num_threads, deterministic))
        ray.get([r.__ray_ready__.remote() for r in self.ranks])
        logger.info("trainer group of %d FSDP ranks ready (rendezvous %s)", self.world_size,
                    init_method)

    def _all(self, method: str, *args):
        """``method`` on every rank at once; rank 0's result."""
        import ray
        return ray.get([getattr(r, method).remote(*args) for r in self.ranks])[0]

    def _rank0(self, method: str, *args):
        import ray
        return ray.get(getattr(self.ranks[0], method).remote(*args))

    def train_step(self, samples: list[dict]) -> dict:
        """One optimizer step over ``samples``, split across the ranks; PolicyTrainer's
        statistics (see the module docstring)."""
        import ray
        runs = split_evenly(samples, self.world_size)
        parts = ray.get([r.train_part.remote(run) for r, run in zip(self.ranks, runs)])
        return step_stats(parts, parts[0]["grad_norm"], parts[0]["tokens"],
                          max(p["train_s"] for p in parts),
                          tis=self.options.get("loss_correction", "none") == "tis")

    def named_weights(self) -> dict:
        """The full weights (rank 0's gather)."""
        return self._all("named_weights")

    def write_shared(self, directory: str = "/dev/shm"):
        return self._all("write_shared", directory)

    def put_payload(self):
        return self._all("put_payload")

    def weight_spec(self):
        return self._all("weight_spec")

    def broadcast(self) -> int:
        return self._all("broadcast")

    def broadcast_address(self) -> tuple[str, int]:
        return self._rank0("broadcast_address")

    def open_broadcast(self, master_address: str, master_port: int, world_size: int,
                       group_name: str = "weight_update_group", backend: str = "gloo") -> None:
        return self._rank0("open_broadcast", master_address, master_port, world_size,
                           group_name, backend)

    def attach_fault_injector(self, injector) -> None:
        return self._rank0("attach_fault_injector", injector)

    def close(self) -> None:
        """Close every rank and end its actor."""
        import ray
        try:
            ray.get([r.close.remote() for r in self.ranks])
        finally:
            for r in self.ranks:
                ray.kill(r)
            self.ranks = []


def trainer_group_actor_class():
    import ray
    return ray.remote(TrainerGroup)
