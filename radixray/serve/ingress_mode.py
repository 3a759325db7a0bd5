"""Where HTTP enters Ray Serve: through Serve's proxy actor, or straight into the ingress
replica (Ray Serve's *direct ingress*).

With the proxy, every request and every streamed chunk crosses one more process: the
proxy parses HTTP, forwards ASGI messages to the ingress replica over Ray and relays
each response chunk back. On a small host that process competes with the engine for
the cores (measured in docs/benchmarks.md, "Direct ingress"). With direct ingress
the ingress replica runs its own HTTP server on a port of its node and the proxy
stays idle.

Ray Serve reads the switch from environment variables when ``ray.serve`` is first
imported, in the driver and in every Serve actor. So the mode can only be chosen
for a Ray instance this process starts: :func:`prepare_local_ray` sets the variables
before ``ray.init``; a cluster started elsewhere uses whatever its own environment
says (for KubeRay, the RayService pod env; see the README).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Literal

IngressMode = Literal["auto", "direct", "proxy"]

# Seconds Serve's controller waits for a starting proxy to answer its readiness check (Ray's
# default is 5; three misses in a row and the proxy is killed, which makes serve.start fail).
# On a 2-vCPU host still loading another server the proxy, a Ray worker at niceness 15, can
# need longer than that.
LOCAL_PROXY_READY_TIMEOUT_S = 30.0

# Seconds a direct-ingress replica stays open after it is told to stop, so an external
# load balancer can take it out first. The CLI drains in-flight requests itself before
# shutting Serve down and has no balancer in front, so it keeps the wait short.
LOCAL_DRAINING_PERIOD_S = 1.0


@dataclass(frozen=True)
class IngressPlan:
    """What a locally started Serve instance listens on.

    ``mode`` is "direct" or "proxy". ``ports`` are where clients connect: the ingress
    replicas' own ports (direct) or Serve's proxy port (proxy). ``proxy_port`` is what
    ``serve.start(http_options=...)`` gets: the public port in proxy mode, a free
    loopback port the proxy idles on in direct mode.
    """

    mode: Literal["direct", "proxy"]
    ports: tuple[int, ...]
    proxy_port: int

    @property
    def env(self) -> dict[str, str]:
        """Ray Serve's environment variables for this plan (empty for the proxy)."""
        if self.mode == "proxy":
            return {}
        return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                # the allocator hands out [min, max): one port per ingress replica
                "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(self.ports[0]),
                "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(self.ports[-1] + 1),
                "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(LOCAL_DRAINING_PERIOD_S)}


def resolve_mode(mode: IngressMode, ingress_replicas: int) -> Literal["direct", "proxy"]:
    """``auto`` is direct for one ingress replica (one port to publish) and the proxy for
    several (the proxy spreads one port over them)."""
    if mode == "auto":
        return "direct" if ingress_replicas == 1 else "proxy"
    return mode


def plan_ingress(mode: IngressMode, port: int, ingress_replicas: int, host: str) -> IngressPlan:
    """Decide the ports of a local Serve instance (see :class:`IngressPlan`)."""
    resolved = resolve_mode(mode, ingress_replicas)
    if resolved == "proxy":
        return IngressPlan("proxy", (port,), port)
    if port + ingress_replicas - 1 > 65535:
        raise ValueError(f"server.port {port} leaves no room for {ingress_replicas} ingress "
                         f"replica ports (direct ingress gives each its own, port upwards)")
    return IngressPlan("direct", tuple(range(port, port + ingress_replicas)), _free_port(host))


def prepare_local_ray(plan: IngressPlan) -> None:
    """Put ``plan.env`` into this process's environment, which the Ray instance that
    ``ray.init`` starts next (and every Serve actor in it) inherits, with a proxy readiness
    timeout that tolerates a busy host (unless the environment already sets one).

    Raises RuntimeError when direct ingress is asked for but ``ray.serve`` was
    already imported here without it: the driver would then disagree with its actors.
    """
    if plan.mode == "direct" and "ray.serve._private.constants" in sys.modules:
        from ray.serve._private import constants
        if not constants.RAY_SERVE_ENABLE_DIRECT_INGRESS:
            raise RuntimeError("direct ingress must be chosen before ray.serve is imported; "
                               "set server.ingress: proxy or import ray.serve later")
    os.environ.update(plan.env)
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(LOCAL_PROXY_READY_TIMEOUT_S))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        return s.getsockname()[1]
