"""The scheduler's side of structured output: the grammar queue, masks, accept, metrics.

A request with a constraint does not enter the waiting queue at once: it waits in the
grammar queue until its grammar is compiled (on the backend's threads), so a slow compile
never blocks other requests. Each compile that finishes posts a wake-up to the scheduler's
inbox; the scheduler then calls :meth:`GrammarManager.poll`, which hands back the ready
requests (each with a fresh matcher) and the failed ones (a 400 error finish).
"""

from __future__ import annotations

from collections.abc import Callable

from radixray.engine.grammar.backend import GrammarBackend
from radixray.engine.grammar.matcher import GrammarState
from radixray.engine.grammar.spec import spec_of
from radixray.engine.request import FinishReason, Req

INVALID_GRAMMAR_STATUS = 400


class GrammarWake:
    """Inbox item: a grammar compile finished; poll the grammar queue."""


class GrammarManager:
    """Owned by the scheduler and used on its thread only (the backend is the thread-safe part)."""

    def __init__(self, backend: GrammarBackend, wake: Callable[[], None]):
        """``wake``: thread-safe, makes the scheduler thread call :meth:`poll` soon."""
        self.backend = backend
        self._wake = wake
        self.queue: list[tuple[Req, object]] = []  # (request, future compiled grammar)
        self.num_requests = 0  # structured-output requests taken in

    @property
    def reqs(self) -> list[Req]:
        """Requests waiting for their grammar."""
        return [r for r, _ in self.queue]

    def hold(self, req: Req) -> bool:
        """Take ``req`` into the grammar queue if it has a constraint (True); False if it has
        none and goes straight to the waiting queue."""
        spec = spec_of(req.sampling)
        if spec is None:
            return False
        self.num_requests += 1
        fut = self.backend.compile(spec)
        self.queue.append((req, fut))
        fut.add_done_callback(lambda _: self._wake())
        return True

    def poll(self) -> tuple[list[Req], list[tuple[Req, FinishReason]]]:
        """(requests whose grammar is ready, each given its matcher; requests whose grammar
        failed, each with its error finish of status 400, for the scheduler to finish).
        Order of arrival is kept."""
        ready, failed, waiting = [], [], []
        for req, fut in self.queue:
            if not fut.done():
                waiting.append((req, fut))
                continue
            exc = fut.exception()
            if exc is not None:
                failed.append((req, FinishReason("error", message=str(exc),
                                                 status=INVALID_GRAMMAR_STATUS)))
            else:
                req.grammar = GrammarState(self.backend.matcher, fut.result())
                ready.append(req)
        self.queue = waiting
        return ready, failed

    def remove(self, rid: str) -> Req | None:
        """Take the request ``rid`` out of the grammar queue (abort); None if not there."""
        for i, (req, _) in enumerate(self.queue):
            if req.rid == rid:
                del self.queue[i]
                return req
        return None

    def snapshot(self) -> dict:
        """Metrics: queue length, compiles and their seconds, failures, cache hits, requests."""
        b = self.backend
        return {"queue": len(self.queue), "requests": self.num_requests,
                "compiles": b.compiles, "compile_seconds": b.compile_seconds,
                "compile_failures": b.compile_failures, "cache_hits": b.cache_hits}

    @classmethod
    def create(cls, config, stop_checker, vocab_size: int, wake: Callable[[], None]):
        """The manager of an engine: its tokenizer and EOS ids from ``stop_checker``."""
        backend = GrammarBackend(stop_checker.tokenizer, vocab_size, stop_checker.eos_token_ids,
                                 threads=config.grammar_compile_threads,
                                 cache_size=config.grammar_cache_size,
                                 json_max_whitespace=config.grammar_json_max_whitespace)
        return cls(backend, wake)
