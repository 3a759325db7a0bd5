"""Speculative-decoding options: the checks at config time and the running-request cap.

Imports no torch: ``EngineConfig`` calls :func:`check_speculative` on construction, and the
cluster reads the config schema without torch.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SPECULATIVE_ALGORITHMS = (None, "NGRAM")
# SGLang (v0.5.22) resets max_running_requests to this when speculation is on and it was
# not set: verify steps hold draft tokens' KV and pay off at small batch.
SPECULATIVE_MAX_RUNNING_DEFAULT = 48


def check_speculative(config) -> None:
    """ValueError naming the field when a speculative config cannot run: a disaggregated
    engine (its decode side receives KV from a peer step by step), expert parallelism (the
    ranks of a group step in lockstep with one token each), or a window range whose minimum
    exceeds its maximum. Nothing to check when ``speculative_algorithm`` is None."""
    algo = config.speculative_algorithm
    if algo is None:
        return
    if config.disaggregation_mode is not None:
        raise ValueError(f"speculative_algorithm={algo!r} cannot run with disaggregation_mode="
                         f"{config.disaggregation_mode!r}: leave one of them unset")
    if config.ep_size > 1:
        raise ValueError(f"speculative_algorithm={algo!r} cannot run with ep_size="
                         f"{config.ep_size}: expert-parallel ranks step one token at a time "
                         "together; use ep_size=1")
    lo = config.speculative_ngram_min_match_window_size
    hi = config.speculative_ngram_max_match_window_size
    if lo > hi:
        raise ValueError(f"speculative_ngram_min_match_window_size ({lo}) must not exceed "
                         f"speculative_ngram_max_match_window_size ({hi})")


def speculative_running_rows(config, default_rows: int) -> int:
    """The default of max_running_requests: ``default_rows``, or 48 with speculation on
    (logged once as a warning, since it caps a throughput test). An explicit
    max_running_requests always wins."""
    if config.speculative_algorithm is None or config.max_running_requests is not None:
        return default_rows
    logger.warning("Max running requests is capped at %d for speculative decoding "
                   "(speculative_algorithm=%s); set max_running_requests to change it",
                   SPECULATIVE_MAX_RUNNING_DEFAULT, config.speculative_algorithm)
    return SPECULATIVE_MAX_RUNNING_DEFAULT
