"""What the parts of a scheduler step share: :class:`StepRecord`, the step in progress, and
:class:`StepHost`, the scheduler as those parts see it.

The prefill builder, the decoders and the speculative worker are given the scheduler and
use only what :class:`StepHost` lists: its parts (read), its queues (read, and the
transitions of the prefill being built), and the methods that move requests and deliver
output. Typing them against this protocol keeps them free of the scheduler module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from radixray.engine.request import FinishReason, Req

if TYPE_CHECKING:
    import torch

    from radixray.engine.config import EngineConfig
    from radixray.engine.executor.model_runner import ModelRunner
    from radixray.engine.executor.sampler import SampleOutput, Sampler
    from radixray.engine.faults import StepFaults
    from radixray.engine.mem_cache.kv_manager import KVManager
    from radixray.engine.sched.admission import NewTokenRatio
    from radixray.engine.sched.queues import RequestQueues
    from radixray.engine.sched.stats import SchedulerStats
    from radixray.engine.stop import StopChecker


@dataclass
class StepRecord:
    """Which requests a step took on (a fault fails exactly those) and whether it ran a
    forward pass (an expert-parallel rank that did not must join its peers' exchanges with
    an empty one). Filled by the parts that build and run the step."""

    reqs: list[Req] = field(default_factory=list)
    forwarded: bool = False

    def add(self, reqs: Iterable[Req]) -> None:
        """``reqs`` belong to this step from now on (a request added twice is failed once)."""
        self.reqs.extend(reqs)

    def discard(self, req: Req) -> None:
        """``req`` left this step before it ran (requeued)."""
        if req in self.reqs:
            self.reqs.remove(req)


class StepHost(Protocol):
    """The scheduler, as the parts of its steps use it (scheduler thread only)."""

    config: EngineConfig
    runner: ModelRunner
    kv: KVManager
    sampler: Sampler
    stop_checker: StopChecker
    stats: SchedulerStats
    ratio: NewTokenRatio
    faults: StepFaults
    queues: RequestQueues
    max_running: int

    def process_logits(self, logits: torch.Tensor, reqs: list[Req], prefill: bool) -> None: ...

    def process_sampled_decode(self, out: SampleOutput | None, reqs: list[Req]) -> None: ...

    def report_decoded(self, reqs: list[Req]) -> None: ...

    def log_decode_interval(self) -> None: ...

    def token_usage(self) -> tuple[int, float]: ...

    def retract(self, req: Req) -> None: ...

    def finish(self, req: Req, reason: FinishReason, release: bool = True) -> None: ...

    def end_request(self, req: Req, reason: FinishReason, release: bool = True) -> None: ...

    def fail_step(self, exc: Exception, reqs: list[Req]) -> None: ...

    def after_prefill_chunk(self, req: Req) -> None: ...
