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
``chunked_prefill_size`` for prompts, so many streams cannot starve a prefill.
KV: the riders' decode slots are allocated after the prefill's (the budget kept one per
rider free); if the pool cannot hold them all, they sit the forward out and the next
decode step retracts as before.
"""

from __future__ import annotations

import torch

from radixray.engine.executor.forward_batch import ForwardBatch
from radixray.engine.request import Req
from radixray.engine.sched.admission import PrefillBudget


def reserve_decode_tokens(s, budget: PrefillBudget) -> None:
    """Scheduler ``s`` with mixing on: take the riders' tokens (one per running request) out of
    ``budget``; the chunk gives at most half of itself. A no-op with mixing off."""
    n = len(s.running) if s.config.enable_mixed_chunk else 0
    if not n:
        return
    budget.rem_total_tokens -= n
    budget.rem_input_tokens -= n
    if budget.rem_chunk_tokens is not None:
        budget.rem_chunk_tokens -= min(n, budget.rem_chunk_tokens // 2)


def build(s, items: list[tuple[Req, int, torch.Tensor]]) -> tuple[ForwardBatch, list[Req]]:
    """Scheduler ``s``, with the prefill's slots allocated: the step's forward batch (``items``:
    request, new tokens, their slots) and the riders in it, at its tail (none with mixing
    off or nothing running)."""
    riders, rider_slots = take_riders(s) if s.config.enable_mixed_chunk else ([], None)
    chunks = [(r, n) for r, n, _ in items] + [(r, 1) for r in riders]
    slots = [slot for _, _, slot in items] + ([rider_slots] if riders else [])
    batch = s.runner.build_extend_batch(chunks, slots)
    batch.num_decode = len(riders)
    return batch, riders


def take_riders(s) -> tuple[list[Req], torch.Tensor | None]:
    """The running requests of scheduler ``s`` that ride in this forward, and one decode slot
    each (reserved until committed). All ride, or none: when the pool cannot hold a slot per
    running request after the prefill's allocation, they sit this forward out, as without
    mixing, and the next decode step retracts as usual (retracting or aborting here could
    end a request that the unmixed schedule would have kept). A step with riders counts as
    a decode step for the new-token-ratio forecast. The riders join the step's batch
    (``s._batch``), so a fault in the step fails them too."""
    if not s.running or s.kv.available_tokens() < len(s.running):
        return [], None
    riders = list(s.running)
    slots = s.kv.extend_decode(riders)
    if slots is None:  # available_tokens promised room
        raise RuntimeError(f"no KV slots for {len(riders)} decode requests")
    s.ratio.step()
    s._batch.extend(riders)
    return riders, slots


def finish_riders(s, logits: torch.Tensor, riders: list[Req]) -> None:
    """After the forward: the riders' KV is computed; their tokens are sampled and processed
    as a decode step's (``logits``: one row per rider). A no-op without riders."""
    if not riders:
        return
    for r in riders:
        r.commit_kv(1)
    s.stats.note_decode(len(riders))
    s.stats.mixed_forwards += 1
    s.stats.mixed_decode_tokens += len(riders)
    s._sample_and_process(logits, riders, prefill=False)
