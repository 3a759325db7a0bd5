"""``radixray serve``: start (or join) Ray, deploy the app, wait for SIGTERM, drain, exit 0.

Every engine option is a flag (derived from EngineConfig), plus the common server, fleet
and router settings; everything else comes from ``--config`` YAML (validated by
ServeConfig). A flag given on the command line overrides the file.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time

from radixray.cluster.routing import POLICIES
from radixray.engine import options
from radixray.engine.config import EngineConfig

logger = logging.getLogger("radixray.serve")

# flag -> (section, field) for the flags that are not engine options (those are derived from
# EngineConfig: every option is a flag of the same name, see engine/options.py)
_FLAG_FIELDS = {
    "host": ("server", "host"), "port": ("server", "port"),
    "served_model_name": ("server", "served_model_name"),
    "ingress_replicas": ("server", "ingress_replicas"), "ingress": ("server", "ingress"),
    "log_level": ("server", "log_level"),
    "workers": ("fleet", "workers"), "router_policy": ("router", "policy"),
    "prefill_workers": ("fleet", "prefill_workers"), "decode_workers": ("fleet", "decode_workers"),
    "api_key": ("server", "api_key"), "admin_api_key": ("server", "admin_api_key"),
}


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI + native APIs) on Ray Serve")
    p.add_argument("--config", help="YAML file (see configs/serve/default.yaml); flags override it")
    options.add_flags(p, EngineConfig, with_defaults=False)
    p.add_argument("--host", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--served-model-name")
    p.add_argument("--ingress-replicas", type=int)
    p.add_argument("--ingress", choices=["auto", "direct", "proxy"],
                   help="where HTTP enters a local Ray: direct (into the ingress replica, "
                   "no proxy hop), proxy (Serve's proxy actor), auto (default: direct for one "
                   "ingress replica)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--workers", type=int, help="engine workers (default 1), each with its own "
                   "model copy and KV pool")
    p.add_argument("--prefill-workers", type=int, help="prefill-decode disaggregation: this "
                   "many prefill workers (with --decode-workers; instead of --workers)")
    p.add_argument("--decode-workers", type=int, help="prefill-decode disaggregation: this "
                   "many decode workers; the KV moves between them over Mooncake (TCP)")
    p.add_argument("--router-policy",
                   choices=POLICIES,
                   help="how requests are spread over the workers (default cache_aware)")
    p.add_argument("--api-key", help="key the OpenAI and native APIs ask for (Authorization: "
                   "Bearer); default RADIXRAY_API_KEY, else open")
    p.add_argument("--admin-api-key", help="key every control route asks for; default "
                   "RADIXRAY_ADMIN_API_KEY, else control routes answer on a loopback host only")
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
    for flag, (section, field) in _FLAG_FIELDS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.setdefault(section, {})[field] = value
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
    start_serve(serve, server.host, plan.proxy_port)
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=server.route_prefix,
              blocking=False)
    bases = [f"http://{server.host}:{port}" for port in plan.ports]
    if not all(wait_ready(base, stop) for base in bases):
        return drain_and_exit(cfg, stop, args.drain_timeout)
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
