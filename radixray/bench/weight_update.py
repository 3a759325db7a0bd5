"""``radixray bench weight-update``: how long a weight update takes, per path and phase.

One in-process engine (the default model unless ``--model``) takes ``--repeats`` full
updates (every tensor) by each path, and the median of each phase is reported:

- ``tensor``: ``update_weights_from_tensor`` with tensors already in this process (a
  colocated trainer's hand-off, no copy before the engine's own);
- ``disk``: ``update_weights_from_disk`` from a safetensors file (warm in the page cache);
- ``distributed``: a trainer process (rank 0) broadcasts every tensor over gloo on
  loopback into ``update_weights_from_distributed``.

Each update is timed end to end (begin -> stage -> end) and by the session's phases:
``transfer`` (staging, fusion by position), ``load`` (rows not sent, int8 repacking) and
``commit`` (the swap, between two scheduler steps). The colocated rental around an
update is timed too: ``pause`` (retract) + ``release`` (kv_cache and weights) and
``resume`` + ``continue``. Decode speed at batch 1 is measured before the first update
and after the last one, so an update that slowed the engine would show.

With ``--tp-size N`` the engine is tensor parallel (N ranks, one process each): the disk
path reads the file on every rank, the tensor and distributed paths reach the driver once
and the driver relays the full tensors to the followers (engine/tp/weights.py), so the
relay's cost is the difference to ``--tp-size 1``.

With ``--fleet N`` the same updates run through a local Ray fleet of N workers instead
(the controller's ``update_weights``, all or none): ``tensor`` is a colocated trainer
writing its tensors into a reused shared-memory file (timed as ``put``) that every worker
reads in place, ``object-store`` the same through ``ray.put(to_payload(...))``, ``disk``
every worker reading the file; phases add the fleet's ``pause`` (retract) and ``resume``
(continue).

    radixray bench weight-update --repeats 5
    radixray bench weight-update --quantization w8a8_int8 --paths tensor
    radixray bench weight-update --fleet 1 --paths tensor,object-store,disk
    radixray bench weight-update --tp-size 3 --repeats 3
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from radixray.bench import add_engine_arguments, save_json
from radixray.cluster.weight_sources import DiskWeights, TensorWeights
from radixray.engine.control import MEMORY_TAGS

logger = logging.getLogger(__name__)

PATHS = ("tensor", "disk", "distributed")

_TRAINER = """
import sys
from safetensors.torch import load_file
from radixray.engine.weights.sync import WeightBroadcaster
port, path, repeats = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
named = sorted(load_file(path).items())
sender = WeightBroadcaster("127.0.0.1", port, world_size=2, group_name="bench", timeout_s=600)
for _ in range(repeats):
    sender.send(named)
sender.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _decode_rate(engine, tokens: int = 64, runs: int = 5) -> float:
    """Output tokens per second of one greedy request (batch 1), median of ``runs``."""
    params = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
    engine.generate(input_ids=[1000, 2000, 3000], sampling_params=params)  # warm
    rates = []
    for i in range(runs):
        t0 = time.perf_counter()
        engine.generate(input_ids=[1001 + i, 2001, 3001], sampling_params=params)
        rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def _one_update(engine, version: int, stage) -> dict:
    t0 = time.perf_counter()
    engine.begin_weight_update()
    staged = stage()
    result = engine.end_weight_update(version)
    return {"total": time.perf_counter() - t0, **result["phases"], "bytes": staged["bytes"]}


def _rental(engine) -> dict:
    """Pause + release (kv_cache, weights), then resume + continue: the colocated round trip."""
    t0 = time.perf_counter()
    engine.pause_generation("retract")
    released = engine.release_memory_occupation(list(MEMORY_TAGS))
    t1 = time.perf_counter()
    engine.resume_memory_occupation(list(MEMORY_TAGS))
    engine.continue_generation()
    return {"release": t1 - t0, "resume": time.perf_counter() - t1, "bytes": released["bytes"]}


def _median_rows(samples: list[dict]) -> dict:
    keys = [k for k in samples[0] if k != "bytes"]
    return {k: statistics.median(s[k] for s in samples) for k in keys} | {
        "bytes": samples[0]["bytes"]}


def run(args) -> dict:
    import torch
    from safetensors.torch import save_file

    from radixray import Engine
    from radixray.engine.weights.loader import resolve_model
    from radixray.engine.weights.sync import WeightBroadcaster
    source = resolve_model(args.model)
    named = {name: t.clone() for name, t in source.weights()}
    options = {"max_total_tokens": args.max_total_tokens, "tp_size": args.tp_size}
    if args.quantization:
        options["quantization"] = args.quantization
    results: dict = {"model": args.model, "quantization": args.quantization,
                     "tp_size": args.tp_size,
                     "cpu": torch.backends.cpu.get_cpu_capability(), "repeats": args.repeats,
                     "paths": {}}
    with Engine(model=args.model, **options) as engine, tempfile.TemporaryDirectory() as tmp:
        results["decode_tok_s_before"] = _decode_rate(engine)
        version = 0
        path = os.path.join(tmp, "weights.safetensors")
        save_file({k: v.contiguous() for k, v in named.items()}, path)
        for kind in args.paths:
            samples = []
            trainer, spec = None, None
            if kind == "distributed":
                port = _free_port()
                trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(port), path,
                                            str(args.repeats)])
                engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="bench")
                spec = WeightBroadcaster.spec(sorted(named.items()))
            for _ in range(args.repeats):
                version += 1
                if kind == "tensor":
                    stage = lambda: engine.update_weights_from_tensor(named)  # noqa: E731
                elif kind == "disk":
                    stage = lambda: engine.update_weights_from_disk(path)  # noqa: E731
                else:
                    stage = lambda spec=spec: engine.update_weights_from_distributed(  # noqa: E731
                        *spec, group_name="bench")
                samples.append(_one_update(engine, version, stage))
            if trainer is not None:
                trainer.wait(timeout=600)
                engine.destroy_weights_update_group("bench")
            results["paths"][kind] = _median_rows(samples)
            logger.info("%s: %s", kind, results["paths"][kind])
        results["rental"] = _median_rows([_rental(engine) for _ in range(args.repeats)])
        results["decode_tok_s_after"] = _decode_rate(engine)
    _print(results)
    save_json(results, args.output)
    return results


def run_fleet(args) -> dict:
    """The tensor and disk paths through a local Ray fleet (see the module docstring)."""
    import ray
    import torch
    from safetensors.torch import save_file

    from radixray.cluster.config import ServeConfig
    from radixray.cluster.shared_weights import SharedWeightsWriter
    from radixray.cluster.tensor_payload import to_payload
    from radixray.engine.weights.loader import resolve_model
    from radixray.serve.fleet import get_or_create_controller, start_heartbeats
    for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                       ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    named = {name: t.clone() for name, t in resolve_model(args.model).weights()}
    engine = {"model": args.model, "max_total_tokens": args.max_total_tokens,
              "tp_size": args.tp_size}
    if args.quantization:
        engine["quantization"] = args.quantization
    cfg = ServeConfig.parse({"engine": engine, "fleet": {"workers": args.fleet},
                             "server": {"warmup": False}})
    results: dict = {"model": args.model, "quantization": args.quantization, "fleet": args.fleet,
                     "tp_size": args.tp_size,
                     "cpu": torch.backends.cpu.get_cpu_capability(), "repeats": args.repeats,
                     "paths": {}}
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, namespace=cfg.namespace,
             log_to_driver=False)
    try:
        controller = get_or_create_controller(cfg)
        beats = start_heartbeats(controller, "bench-weight-update", 2.0)
        ray.get(controller.start.remote())
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "weights.safetensors")
            save_file({k: v.contiguous() for k, v in named.items()}, path)
            shared = SharedWeightsWriter(named)
            for kind in [k for k in args.paths if k != "distributed"]:
                samples = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    if kind == "tensor":
                        source = TensorWeights(shared=shared.write(named))
                    elif kind == "object-store":
                        source = TensorWeights(payload=ray.put(to_payload(named)))
                    else:
                        source = DiskWeights(path)
                    put = time.perf_counter() - t0
                    out = ray.get(controller.update_weights.remote(source))
                    samples.append({"total": time.perf_counter() - t0, "put": put,
                                    **out["phases"], "bytes": sum(
                                        t.numel() * t.element_size() for t in named.values())})
                results["paths"][kind] = _median_rows(samples)
                logger.info("%s: %s", kind, results["paths"][kind])
            shared.close()
        ray.get(controller.stop_fleet.remote())
        beats.set()
    finally:
        ray.shutdown()
    print(f"\nfleet weight update ({args.fleet} worker(s), TP {args.tp_size}), {args.model}, "
          f"quantization "
          f"{args.quantization}, CPU {results['cpu']}, median of {args.repeats}")
    for kind, row in results["paths"].items():
        print(f"{kind:<8} total {row['total']:.3f} s: " + ", ".join(
            f"{k} {v:.3f}" for k, v in row.items() if k not in ("total", "bytes")))
    save_json(results, args.output)
    return results


def _print(results: dict) -> None:
    mib = next(iter(results["paths"].values()))["bytes"] / 2**20 if results["paths"] else 0
    print(f"\nweight update, {results['model']} ({mib:.0f} MiB staged), quantization "
          f"{results['quantization']}, TP {results.get('tp_size', 1)}, CPU {results['cpu']}, "
          f"median of {results['repeats']}")
    print(f"{'path':<12}{'total s':>9}{'transfer':>10}{'load':>8}{'commit':>8}{'GB/s':>7}")
    for kind, row in results["paths"].items():
        rate = row["bytes"] / row["total"] / 1e9
        print(f"{kind:<12}{row['total']:>9.3f}{row['transfer']:>10.3f}{row['load']:>8.3f}"
              f"{row['commit']:>8.4f}{rate:>7.2f}")
    rental = results["rental"]
    print(f"rental (kv_cache + weights, {rental['bytes'] / 2**20:.0f} MiB): pause+release "
          f"{rental['release']:.3f} s, resume+continue {rental['resume']:.3f} s")
    print(f"decode at batch 1: {results['decode_tok_s_before']:.1f} tok/s before, "
          f"{results['decode_tok_s_after']:.1f} after")


def add_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("weight-update", help="weight update time per path and phase")
    add_engine_arguments(p, ("model", "quantization", "max_total_tokens", "tp_size"),
                         max_total_tokens=8192)
    p.add_argument("--paths", default=",".join(PATHS),
                   type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fleet", type=int, default=0,
                   help="run through a local Ray fleet of this many workers (tensor, disk)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=lambda args: ((run_fleet if args.fleet else run)(args), 0)[1])
