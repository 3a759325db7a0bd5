"""Shared fixtures and helpers for the engine API tests (tiny Llama, loopback-free, in-process)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

from radixray import Engine

FFFD = "\ufffd"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def rand_ids(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def wait_until(engine: Engine, pred, timeout: float = 30.0) -> None:
    """Poll ``pred(scheduler)`` on the scheduler thread until it holds."""
    deadline = time.monotonic() + timeout
    while not engine.call_in_loop(pred):
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def is_running(rid: str, min_outputs: int = 1):
    return lambda s: any(r.rid == rid and len(r.output_ids) >= min_outputs for r in s.queues.running)


def is_gone(rid: str):
    return lambda s: all(r.rid != rid for r in s.queues.running + s.queues.waiting) and (
        s.queues.chunked is None or s.queues.chunked.rid != rid)


def in_thread(fn, **kwargs):
    """Run ``fn(**kwargs)`` in a thread; returns (thread, results dict with 'out' and 't')."""
    box: dict = {}

    def target():
        box["out"] = fn(**kwargs)
        box["t"] = time.perf_counter()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def call_with_timeout(fn, timeout: float = 30.0, **kwargs):
    """``fn(**kwargs)`` in a thread: its result, or its exception re-raised; fails on a hang."""
    box: dict = {}

    def target():
        try:
            box["out"] = fn(**kwargs)
        except Exception as exc:  # re-raised in the caller
            box["exc"] = exc
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise AssertionError(f"{getattr(fn, '__name__', fn)} hung")
    if "exc" in box:
        raise box["exc"]
    return box["out"]


def stream(engine: Engine, **kwargs) -> list[dict]:
    async def collect():
        return [c async for c in engine.generate_stream(**kwargs)]
    return asyncio.run(collect())
