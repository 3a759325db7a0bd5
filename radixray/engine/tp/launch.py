"""Forming a tensor-parallel group: joining one a launcher formed (Ray rank actors), or, for
an in-process engine (``Engine(tp_size=N)``), starting its follower ranks as processes of
this machine.

Each follower is a fresh Python process (engine/tp/follower.py) that joins the group, builds
its model runner (its shard of the weights, a KV pool of its heads) and follows the driver's
forward passes (engine/tp/runtime.py) until the driver stops it or dies.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys

from radixray.engine.tp.group import NO_TP, TensorParallel

logger = logging.getLogger(__name__)

STOP_WAIT_S = 30.0


def _backend(config) -> str:
    return "nccl" if config.device.startswith("cuda") else "gloo"


def join_tp_group(config, rank: int = 0, init_method: str | None = None
                  ) -> tuple[TensorParallel, LocalFollowers | None]:
    """This engine's TensorParallel (NO_TP with tp_size 1) and, when it had to start its
    followers itself (rank 0 without a rendezvous), their processes."""
    if config.tp_size == 1:
        return NO_TP, None
    followers = None
    if init_method is None:
        if rank != 0:
            raise ValueError(f"tp_rank {rank} needs tp_init_method, the rendezvous of rank 0")
        from radixray.engine.ep.group import free_tcp_address
        TensorParallel.check_joinable(config.tp_size)  # before any follower starts
        init_method = free_tcp_address()
        followers = LocalFollowers(config, init_method)
    try:
        tp = TensorParallel.join(rank, config.tp_size, init_method, _backend(config),
                                 config.tp_timeout_s)
    except BaseException:
        if followers is not None:
            followers.kill()  # no group formed: they have nothing to finish
        raise
    return tp, followers


class LocalFollowers:
    """Ranks 1..tp_size-1 of an in-process engine's group, one process each
    (``python -m radixray.engine.tp.follower``, given the config as JSON)."""

    def __init__(self, config, init_method: str):
        spec = json.dumps(dataclasses.asdict(config))
        self.processes = [subprocess.Popen(
            [sys.executable, "-m", "radixray.engine.tp.follower", "--rank", str(rank),
             "--init-method", init_method, "--config", spec])
            for rank in range(1, config.tp_size)]
        logger.info("started %d tensor-parallel follower process(es) for %s",
                    len(self.processes), init_method)

    def kill(self) -> None:
        """End the followers at once (the group never formed)."""
        for p in self.processes:
            p.kill()
            p.wait()

    def stop(self) -> None:
        """Wait for the followers to leave (after the driver sent Stop); kill stragglers."""
        for p in self.processes:
            try:
                p.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel follower %d did not stop; killing it", p.pid)
                p.kill()
                p.wait()
