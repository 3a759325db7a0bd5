"""Which engine options tensor parallelism works with so far, and its start-up log line.

A refused combination raises ValueError naming both options before any rank joins a group.
What is refused today is what the followers cannot mirror yet (they run forward passes
only, weight-update sessions and memory releases): state the driver changes outside a
forward pass (the host tier) and expert placement (expert parallelism, EPLB).
"""

from __future__ import annotations

from radixray.engine.tp.sharding import TPShard, check_tp_size

# option -> (the value TP works with today, why not otherwise)
_NOT_YET = {
    "ep_size": (1, "expert parallelism inside a tensor-parallel group"),
    "enable_eplb": (False, "expert rebalancing (the followers would keep the old placement)"),
    "ep_num_redundant_experts": (0, "redundant expert slots"),
    "enable_hierarchical_cache": (False, "the hierarchical cache (host-tier copies on every "
                                         "rank)"),
    "enable_return_routed_experts": (False, "routed experts (MoE models)"),
}


def check_tp_options(config, hf_config) -> None:
    """ValueError when ``config.tp_size`` does not suit the model (head counts) or an option
    it does not work with yet."""
    if config.tp_size == 1:
        return
    check_tp_size(hf_config, config.tp_size)
    for name, (wanted, what) in _NOT_YET.items():
        if getattr(config, name) != wanted:
            raise ValueError(f"tp_size={config.tp_size} with {name}={getattr(config, name)!r}: "
                             f"{what} is not implemented yet")


def tp_summary(tp, model) -> str:
    """``, tensor-parallel rank r of n: q heads, kv heads, ...`` for the model load log (empty
    with one rank)."""
    if tp.size == 1:
        return ""
    shard: TPShard = model.tp_shard
    return (f", tensor-parallel rank {tp.rank} of {tp.size}: {shard.local_heads} of "
            f"{shard.num_heads} query heads, {shard.local_kv_heads} of {shard.num_kv_heads} KV "
            f"heads (from head {shard.kv_head_start}), {shard.local_intermediate} of "
            f"{shard.intermediate_size} MLP rows, vocabulary rows {shard.vocab_start}.."
            f"{shard.vocab_start + shard.local_vocab}")
