"""A tensor-parallel follower rank: ``python -m radixray.engine.tp.follower --rank R
--init-method tcp://host:port --config '<EngineConfig as JSON>'`` (how an in-process
engine starts its followers, engine/tp/launch.py), or :func:`run_follower` in a process
that is already one (a Ray rank actor)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging


def run_follower(config, rank: int, init_method: str, own_device: bool = False) -> None:
    """A follower rank's whole life: join the group, build its model runner, follow the
    driver's forward passes until it stops (or dies), leave. ``own_device``: this process
    sees only its own GPU (a Ray rank actor); otherwise it sees the group's, one per rank."""
    from radixray.engine.executor.model_runner import ModelRunner
    from radixray.engine.tp.runtime import follow
    from radixray.engine.weights.loader import resolve_model
    if config.device == "cuda" and not own_device:
        config = dataclasses.replace(config, device=f"cuda:{rank}")
    runner = ModelRunner(config, resolve_model(config.model), tp_rank=rank,
                         tp_init_method=init_method)
    kv = None
    try:
        if config.disaggregation_mode is not None:  # the driver's PDLink gathers with it
            from radixray.engine.disaggregation.tp_group import FollowerKV
            kv = FollowerKV(runner, config, runner.tp)
        follow(runner, runner.tp, kv)
    finally:
        if kv is not None:
            kv.close()
        runner.tp.leave()


def main(argv: list[str] | None = None) -> None:
    from radixray.engine.config import EngineConfig
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--config", required=True, help="the EngineConfig's fields as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s] tp{args.rank} %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    run_follower(EngineConfig(**json.loads(args.config)), args.rank, args.init_method)


if __name__ == "__main__":
    main()
