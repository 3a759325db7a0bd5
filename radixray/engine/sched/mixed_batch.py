"""Mixed chunked prefill (``enable_mixed_chunk``): running decode requests ride along in a
prefill forward.

Without it a step is either a prefill (new requests, or the next chunk of a chunked one)
or a decode, so every running stream waits for a whole prefill wave. With it, a prefill
step also carries every running request as an extend of one token at position
``kv_len`` (its last output token), at the tail of the same :class:`ForwardBatch`
(``num_decode``); attention runs those rows through the decode path
(``AttentionBackend.forward_mixed``), so each rider computes what a decode step would
have, and its token is sampled, stop-checked and streamed by the scheduler's decode
handling. A stream's longest gap then shrinks from a prefill wave to one chunk's forward.

Budget (as SGLang counts it): the riders' tokens come out of the prefill batch's token
budget, its input budget and its chunk, but the chunk keeps at least half of
``chunked_prefill_size`` for prompts (:meth:`PrefillBudget.reserve_riders`).
KV: the riders' decode slots are allocated after the prefill's (the budget kept one per
rider free); if the pool cannot hold them all, they sit the forward out and the next
decode step retracts as before.
"""

from __future__ import annotations

import torch

from radixray.engine.executor.forward_batch import ForwardBatch
from radixray.engine.executor.model_runner import ModelRunner
from radixray.engine.mem_cache.kv_manager import KVManager
from radixray.engine.request import Req
from radixray.engine.sched.admission import NewTokenRatio
from radixray.engine.sched.stats import SchedulerStats


class MixedChunks:
    """The riders of a scheduler's prefill steps; with ``enabled`` False, none ride."""

    def __init__(self, enabled: bool, kv: KVManager, runner: ModelRunner, ratio: NewTokenRatio,
                 stats: SchedulerStats):
        self.enabled, self.kv, self.runner, self.ratio, self.stats = (enabled, kv, runner, ratio,
                                                                      stats)

    def num_riders(self, num_running: int) -> int:
        """How many running requests a prefill batch must keep budget for."""
        return num_running if self.enabled else 0

    def build(self, items: list[tuple[Req, int, torch.Tensor]],
              running: list[Req]) -> tuple[ForwardBatch, list[Req]]:
        """With the prefill's slots allocated: the step's forward batch (``items``: request,
        new tokens, their slots) and the riders in it, at its tail (none with mixing off or
        nothing running)."""
        riders, rider_slots = self._take_riders(running) if self.enabled else ([], None)
        chunks = [(r, n) for r, n, _ in items] + [(r, 1) for r in riders]
        slots = [slot for _, _, slot in items] + ([rider_slots] if riders else [])
        batch = self.runner.build_extend_batch(chunks, slots)
        batch.num_decode = len(riders)
        return batch, riders

    def _take_riders(self, running: list[Req]) -> tuple[list[Req], torch.Tensor | None]:
        """The ``running`` requests that ride in this forward, and one decode slot each
        (reserved until committed). All ride, or none: when the pool cannot hold a slot per
        running request after the prefill's allocation, they sit this forward out, as without
        mixing, and the next decode step retracts as usual (retracting or aborting here could
        end a request that the unmixed schedule would have kept). A step with riders counts
        as a decode step for the new-token-ratio forecast."""
        if not running or self.kv.available_tokens() < len(running):
            return [], None
        riders = list(running)
        slots = self.kv.extend_decode(riders)
        if slots is None:  # available_tokens promised room
            raise RuntimeError(f"no KV slots for {len(riders)} decode requests")
        self.ratio.step()
        return riders, slots

    def commit_riders(self, riders: list[Req]) -> None:
        """After the forward: the riders' KV is computed (their tokens are then processed as
        a decode step's)."""
        for r in riders:
            r.commit_kv(1)
        self.stats.note_decode(len(riders))
        self.stats.mixed_forwards += 1
        self.stats.mixed_decode_tokens += len(riders)
