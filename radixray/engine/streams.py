"""How a request's output reaches whoever waits for it: a blocking call's event, one
stream's asyncio queue, or a serving client's :class:`StepChannel` (one message per step
for all of its requests)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from radixray.engine.detokenizer import IncrementalDetokenizer
from radixray.engine.executor.prompt_logprobs import input_logprob_entries
from radixray.engine.messages import MetaInfo, RequestUpdate
from radixray.engine.request import Req


class StepChannel:
    """Carries one list of updates per scheduler step to an asyncio queue in another thread.

    Several requests share a channel (one per serving client), so a step with
    many running requests costs one hand-off instead of one per request. A message
    is a list of :class:`~radixray.engine.messages.RequestUpdate` (one step), or a
    control message of the channel's owner.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop = loop
        self.queue = queue

    def push(self, updates: list[RequestUpdate] | object) -> bool:
        """Hand one message (a step's updates, or a control dict) to the reader's loop;
        False when that loop is closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, updates)
            return True
        except RuntimeError:
            return False


@dataclass
class Subscriber:
    """Where one request's progress goes: an event (blocking call), an asyncio queue
    (one stream) or a shared StepChannel (serving)."""

    done: threading.Event = field(default_factory=threading.Event)
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    channel: StepChannel | None = None


def take_update(req: Req, weight_version: int | str = 0) -> RequestUpdate:
    """The output ``req`` produced since its last update (and its MetaInfo once finished;
    ``weight_version``: the engine's current one)."""
    update = RequestUpdate(req.rid, req.output_ids[req.emitted:])
    if req.sampling.return_logprob:
        update.logprobs = req.output_logprobs[req.emitted:]
        if req.sampling.top_logprobs_num:
            update.top_logprobs = req.output_top_logprobs[req.emitted:]
        if not req.input_logprobs_sent and not req.input_logprobs_pending:
            update.input_logprobs, update.input_top_logprobs = input_logprob_entries(req)
            req.input_logprobs_sent = True
    req.emitted = len(req.output_ids)
    if req.finished:
        update.meta = MetaInfo.of(req, weight_version)
        if req.finish_reason.type == "error":
            update.error, update.status = req.finish_reason.message, req.finish_reason.status
    return update


class Subscribers:
    """The subscriber of every unfinished request, by rid, and the hand-off of each step's
    output to them.

    ``weight_version()`` stamps finished requests; ``abort(rid)`` is called for a request
    whose reader went away. :meth:`deliver` runs on the scheduler thread; the rest on any.
    """

    def __init__(self, stream_interval: int, weight_version: Callable[[], int | str],
                 abort: Callable[[str], None]):
        self.stream_interval = stream_interval
        self.weight_version, self.abort = weight_version, abort
        self._subs: dict[str, Subscriber] = {}
        self._lock = threading.Lock()

    def add(self, reqs: list[Req], subs: list[Subscriber]) -> None:
        """Subscribe each request; ValueError (nothing added) when a rid is still in use."""
        with self._lock:
            busy = [r.rid for r in reqs if r.rid in self._subs]
            if busy:
                raise ValueError(f"rid {busy[0]!r} is already in use by an unfinished request")
            for req, sub in zip(reqs, subs):
                self._subs[req.rid] = sub

    def discard(self, rid: str) -> None:
        with self._lock:
            self._subs.pop(rid, None)

    def deliver(self, reqs: list[Req]) -> None:
        """Hand each request's new output to its subscriber. With ``stream_interval`` N > 1 a
        running request's tokens are held until N of them wait (the first token and the
        finish always go at once), which cuts per-token work downstream by about N."""
        batches: dict[int, tuple[StepChannel, list[RequestUpdate], list[Req]]] = {}
        interval = self.stream_interval
        for req in reqs:
            sub = self._subs.get(req.rid)
            if sub is None:
                continue
            if interval > 1 and not req.finished and req.emitted \
                    and len(req.output_ids) - req.emitted < interval:
                continue
            if sub.channel is not None:
                entry = batches.setdefault(id(sub.channel), (sub.channel, [], []))
                entry[1].append(take_update(req, self.weight_version()))
                entry[2].append(req)
                if req.finished:
                    self.discard(req.rid)
                continue
            if sub.queue is not None:
                chunk = take_update(req, self.weight_version())
                try:
                    sub.loop.call_soon_threadsafe(sub.queue.put_nowait, chunk)
                except RuntimeError:  # the reader's event loop is closed: nobody reads on
                    self._drop_readerless([req])
                    continue
            if req.finished:
                sub.done.set()
        for channel, updates, sent in batches.values():
            if not channel.push(updates):
                self._drop_readerless(sent)

    def _drop_readerless(self, reqs: list[Req]) -> None:
        """Nobody reads these requests' output any more: forget them and abort the unfinished."""
        for req in reqs:
            self.discard(req.rid)
        for req in reqs:
            if not req.finished:
                self.abort(req.rid)


def _detokenizer(tokenizer, req: Req) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, req.prompt_ids,
                                  skip_special_tokens=req.sampling.skip_special_tokens,
                                  stop=req.sampling.stop)


class StreamChunks:
    """Turns one request's updates into ``Engine.generate_stream`` chunks: ``{"text": delta,
    "output_ids": new ids, "finished": bool}`` plus logprobs and, at the end, ``meta_info``.
    Incomplete UTF-8 characters and text that may still become a stop string are held back."""

    def __init__(self, tokenizer, req: Req):
        self.detok = _detokenizer(tokenizer, req)

    def of(self, update: RequestUpdate) -> dict:
        finished = update.meta is not None
        text = self.detok.add_tokens(update.ids)
        if finished and not self.detok.stopped:
            text += self.detok.finish()
        chunk = {"text": text, "output_ids": update.ids, "finished": finished}
        if update.logprobs is not None:
            chunk["output_token_logprobs"] = update.logprobs
        if update.input_logprobs is not None:
            chunk["input_token_logprobs"] = update.input_logprobs
            if update.input_top_logprobs is not None:
                chunk["input_top_logprobs"] = update.input_top_logprobs
        if finished:
            chunk["meta_info"] = update.meta.to_json()
        return chunk


def finished_result(req: Req, tokenizer, weight_version: int | str) -> dict:
    """A finished request as ``Engine.generate`` returns it: text (stop strings and
    incomplete characters held back as in a stream), ids, meta_info, logprobs if asked:
    ``output_token_logprobs`` (one per output id) and ``input_token_logprobs`` (one per
    prompt position from ``logprob_start_len``, the first None; absent when the request
    ended before its prompt was prefilled), with their ``*_top_logprobs`` when asked."""
    detok = _detokenizer(tokenizer, req)
    text = detok.add_tokens(req.output_ids)
    if not detok.stopped:
        text += detok.finish()
    out = {"text": text, "output_ids": list(req.output_ids),
           "meta_info": MetaInfo.of(req, weight_version).to_json()}
    if req.sampling.return_logprob:
        out["output_token_logprobs"] = list(req.output_logprobs)
        if req.sampling.top_logprobs_num:
            out["output_top_logprobs"] = list(req.output_top_logprobs)
        if not req.input_logprobs_pending:
            values, tops = input_logprob_entries(req)
            out["input_token_logprobs"] = values
            if tops is not None:
                out["input_top_logprobs"] = tops
    return out
