"""Scheduler counters and the two periodic log lines (one per prefill batch, one per N decode steps)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixray.engine.sched.chunk_budget import StepBudget

logger = logging.getLogger("radixray.scheduler")


@dataclass
class SchedulerStats:
    """Monotonic counters a metrics exporter reads; gauges are computed on demand by the scheduler."""

    prompt_tokens: int = 0  # prompt tokens of finished requests' first prefill
    generation_tokens: int = 0
    prefill_input_tokens: int = 0  # tokens prefilled (computed) on this device
    prefill_cached_tokens: int = 0  # prompt tokens served from the radix cache (device hits)
    num_retracted_reqs: int = 0
    num_aborted_reqs: int = 0
    num_finished_reqs: int = 0
    forward_steps: int = 0
    decode_steps: int = 0
    gen_throughput: float = 0.0  # decode tokens/s over the last decode log interval
    mixed_forwards: int = 0  # prefill forwards that carried decode requests (enable_mixed_chunk)
    mixed_decode_tokens: int = 0  # decode tokens computed in those forwards

    def __post_init__(self):
        self._window_start = time.perf_counter()
        self._window_tokens = 0

    def reset(self) -> None:
        """Every counter back to zero, in place (the parts holding this object see it)."""
        self.__init__()

    def note_decode(self, num_tokens: int) -> None:
        self.decode_steps += 1
        self._window_tokens += num_tokens

    def take_gen_throughput(self) -> float:
        """Decode tokens per second since the last call."""
        now = time.perf_counter()
        rate = self._window_tokens / max(now - self._window_start, 1e-9)
        self._window_start, self._window_tokens = now, 0
        return rate


def log_prefill(new_seq: int, new_token: int, cached_token: int, usage: float, running: int,
                queued: int, seconds: float, budget: StepBudget | None = None) -> None:
    """The prefill log line; a step sized by the ITL budget adds its prompt-token budget, its
    predicted and its measured milliseconds."""
    sized = ""
    if budget is not None and budget.sized:
        predicted = "-" if budget.predicted_s is None else f"{budget.predicted_s * 1e3:.0f}"
        sized = (f", #budget-token: {budget.tokens}, step ms predicted: {predicted}, "
                 f"took: {seconds * 1e3:.0f}")
    logger.info(
        "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
        "#running-req: %d, #queue-req: %d, input throughput (token/s): %.2f%s",
        new_seq, new_token, cached_token, usage, running, queued, new_token / max(seconds, 1e-9),
        sized)


def log_decode(running: int, tokens: int, usage: float, gen_throughput: float, queued: int,
               cuda_graph: bool = False) -> None:
    logger.info(
        "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, cuda graph: %s, "
        "gen throughput (token/s): %.2f, #queue-req: %d", running, tokens, usage, cuda_graph,
        gen_throughput, queued)
