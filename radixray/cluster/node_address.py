"""The addresses an actor advertises come from the Ray node it runs on.

A worker's peers (the other half of a prefill-decode pair, a HiCache store's clients, a
tensor-parallel group's ranks) may be on other nodes, so what it listens on is its own
node's address (Ray's node IP), unless the configuration names one.
"""

from __future__ import annotations

import os


def node_local_options(options: dict) -> dict:
    """``options`` with the addresses peers reach on this process's Ray node, unless
    configured: the KV transfer engine's host (prefill-decode), the HiCache store's
    segment host (an environment variable Mooncake reads)."""
    options = dict(options)
    if options.get("disaggregation_mode") and not options.get("disaggregation_transfer_host"):
        options["disaggregation_transfer_host"] = node_ip()
    if options.get("hicache_storage_backend") == "mooncake":
        os.environ.setdefault("MOONCAKE_LOCAL_HOSTNAME", node_ip())
    return options


def node_ip() -> str | None:
    """The address of the Ray node this process runs on (None outside Ray)."""
    import ray
    return ray.util.get_node_ip_address() if ray.is_initialized() else None
