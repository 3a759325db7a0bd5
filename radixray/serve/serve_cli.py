"""``radixray serve``: start (or join) Ray, deploy the app, wait for SIGTERM, drain, exit 0.

Every engine option is a flag (derived from EngineConfig), plus the common server, fleet
and router settings (derived from their ServeConfig sections: :data:`SECTION_FLAGS` names
which); everything else comes from ``--config`` YAML (validated by ServeConfig). A flag
given on the command line overrides the file.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
import types
import typing

from pydantic import SecretStr

from radixray.engine import options
from radixray.engine.config import EngineConfig

logger = logging.getLogger("radixray.serve")

# The config fields that are also flags, as (section, field, flag prefix); the flag is
# --<prefix><field> and takes its type, choices and help from the field's declaration in
# cluster/config.py. The engine options are all flags, derived from EngineConfig.
SECTION_FLAGS = (
    ("server", "host", ""), ("server", "port", ""), ("server", "served_model_name", ""),
    ("server", "ingress_replicas", ""), ("server", "ingress", ""), ("server", "log_level", ""),
    ("server", "step_transport", ""),
    ("fleet", "workers", ""), ("fleet", "prefill_workers", ""), ("fleet", "decode_workers", ""),
    ("router", "policy", "router_"),
    ("server", "api_key", ""), ("server", "admin_api_key", ""),
    ("server", "tool_call_parser", ""), ("server", "reasoning_parser", ""),
    ("server", "generic_tool_prompt", ""),
)


def _section_fields(section: str) -> dict:
    from radixray.cluster.config import ServeConfig
    return ServeConfig.model_fields[section].annotation.model_fields


def add_section_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :data:`SECTION_FLAGS` entry. Unset flags stay None, so the config file's
    value (or the field's default, shown in the help) stands."""
    for section, name, prefix in SECTION_FLAGS:
        info = _section_fields(section)[name]
        kind = info.annotation
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        choices = list(typing.get_args(kind)) if typing.get_origin(kind) is typing.Literal \
            else None
        kind = str if kind is SecretStr or choices else kind
        help_text = info.description or ""
        if info.default is not None and info.default_factory is None:
            help_text += f" (default: {info.default})"
        flag = "--" + (prefix + name).replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, type=kind, choices=choices, help=help_text)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI + native APIs) on Ray Serve")
    p.add_argument("--config", help="YAML file (see configs/serve/default.yaml); flags override it")
    options.add_flags(p, EngineConfig, with_defaults=False)
    add_section_flags(p)
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tp-size", type=int, help=f"tensor-parallel ranks of each "
                       f"{role} worker (fleet.{role}_engine.tp_size; default: --tp-size)")
    p.add_argument("--address", help="join a running Ray cluster (default: start a local one)")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray instance")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds to wait for in-flight requests on SIGTERM (default: no limit)")
    p.set_defaults(func=cmd_serve)


def config_from_args(args):
    from radixray.cluster.config import ServeConfig
    overrides: dict = {}
    engine = options.from_flags(args, EngineConfig)
    if engine:
        overrides["engine"] = engine
    for section, name, prefix in SECTION_FLAGS:
        value = getattr(args, prefix + name, None)
        if value is not None:
            overrides.setdefault(section, {})[name] = value
    for role in ("prefill", "decode"):
        value = getattr(args, f"{role}_tp_size", None)
        if value is not None:
            overrides.setdefault("fleet", {}).setdefault(f"{role}_engine", {})["tp_size"] = value
    if args.config:
        return ServeConfig.load(args.config, overrides)
    return ServeConfig.parse(overrides)


def cmd_serve(args) -> int:
    from radixray.cluster.config import ConfigError
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"radixray serve: {exc}")
        return 2
    from radixray.serve.supervisor import run_supervised, supervised
    argv = getattr(args, "argv", None)  # set by the `radixray` command (cli.main)
    if argv is not None and not args.address and not supervised():
        return run_supervised(argv)  # Ray's processes out of reach of a group signal
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from radixray.serve.ingress_mode import IngressPlan, plan_ingress, prepare_local_ray
    server = cfg.server
    if args.address:  # the cluster's own environment decides; see serve/ingress_mode.py
        if server.ingress == "direct":
            logger.warning("--ingress direct applies to a Ray this command starts; on a running "
                           "cluster set RAY_SERVE_ENABLE_DIRECT_INGRESS=1 in its environment")
        plan = IngressPlan("proxy", (server.port,), server.port)
    else:
        try:
            plan = plan_ingress(server.ingress, server.port, server.ingress_replicas, server.host)
        except ValueError as exc:
            print(f"radixray serve: {exc}")
            return 2
        prepare_local_ray(plan)
    import ray
    from ray import serve

    from radixray.serve.builder import build_app
    from radixray.serve.fleet import prestart_fleet
    if args.address:
        ray.init(address=args.address, namespace=cfg.namespace)
    else:
        ray.init(_node_ip_address="127.0.0.1", num_cpus=args.num_cpus, include_dashboard=False,
                 namespace=cfg.namespace)
    logger.info("ingress: %s on port %s%s", plan.mode, ", ".join(map(str, plan.ports)),
                f" (Serve's proxy idles on {plan.proxy_port})" if plan.mode == "direct" else "")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: (logger.warning(
            "%s received: draining requests and shutting down...", signal.Signals(signum).name),
            stop.set()))
    fleet_beats = prestart_fleet(cfg, f"serve-cli-{os.getpid()}")
    start_serve(serve, server.host, plan.proxy_port)
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=server.route_prefix,
              blocking=False)
    bases = [f"http://{server.host}:{port}" for port in plan.ports]
    if not all(wait_ready(base, stop) for base in bases):
        return drain_and_exit(cfg, stop, args.drain_timeout)
    fleet_beats.set()  # the ingress replicas keep the fleet alive from here on
    print_ready(bases, server.served_model_name, plan.mode)
    stop.wait()
    return drain_and_exit(cfg, stop, args.drain_timeout)


def start_serve(serve, host: str, port: int, attempts: int = 3) -> None:
    """``serve.start``, again if its proxy actor was replaced while starting: Serve's
    controller kills a proxy that misses its readiness checks (a busy host) and starts
    another, but the first call has already failed with ActorDiedError."""
    import ray
    for attempt in range(1, attempts + 1):
        try:
            serve.start(http_options={"host": host, "port": port})
            return
        except ray.exceptions.ActorDiedError as exc:
            if attempt == attempts:
                raise
            logger.warning("Serve's proxy was restarted while starting (%s); waiting for the "
                           "new one (attempt %d of %d)", str(exc).splitlines()[0], attempt + 1,
                           attempts)


def wait_ready(base: str, stop: threading.Event, timeout: float = 1800) -> bool:
    """Poll /ready until 200 (the first call warms the path up); False if stopped first."""
    import httpx
    logging.getLogger("httpx").setLevel(logging.WARNING)
    deadline = time.monotonic() + timeout
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/ready", timeout=600).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        stop.wait(0.25)
    return False


def print_ready(bases: list[str], model: str, ingress: str) -> None:
    base = bases[0]
    more = f"\n  ingress replicas also on: {', '.join(bases[1:])}" if len(bases) > 1 else ""
    print(f"""
radixray is ready: {base}  (model "{model}", {ingress} ingress){more}
  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'
  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='-'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi'}}]).choices[0].message.content)"
  metrics: {base}/metrics   health: {base}/health   stop: Ctrl-C or SIGTERM (drains first)
""", flush=True)


def drain_and_exit(cfg, stop: threading.Event, timeout: float | None) -> int:
    """Drain the fleet (finish in-flight, refuse new), then shut Serve and Ray down."""
    import ray
    from ray import serve

    from radixray.serve.fleet import find_controller
    controller = find_controller(cfg)
    if controller is not None:
        from radixray.serve.drain_cli import drain_fleet
        drain_fleet(controller, timeout)
        time.sleep(1.0)  # let the ingress write the last chunks to its clients
    logger.warning("Gracefully exiting... remaining requests: 0")
    serve.shutdown()
    ray.shutdown()
    return 0


def run_argv(argv: list[str]) -> int:
    """Entry point for tests: parse ``serve`` flags and run."""
    parser = argparse.ArgumentParser(prog="radixray")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *argv])
    return args.func(args)
