"""Releasing and resuming the engine's memory by tag (``kv_cache``, ``weights``) while paused.

This is SGLang's ``release_memory_occupation`` / ``resume_memory_occupation`` for RL:
between rollouts the trainer needs the memory the engine holds, so the engine
gives back the bytes behind its KV pool and its weights and takes them again later.

The bytes themselves (freed with ``resize_(0)``, weights spilled and read back, the KV
pool zero-filled) are :class:`~radixray.engine.mem_cache.storage_saver.StorageSaver`'s
work; this module adds the scheduler's side: the checks, the cache flush, the allocator
reset, and the relay to tensor-parallel followers, which free their shards too.

Both calls run on the scheduler thread (``Engine.call_in_loop``). Generation must be
paused first, and ``continue_generation`` refuses while any tag is released
(``Scheduler.resume`` reads ``scheduler.memory_released``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from radixray.engine.control import MEMORY_TAGS
from radixray.engine.mem_cache.storage_saver import StorageSaver

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class MemoryOp:
    """A release or resume (or the weights replaced by an update) for the tensor-parallel
    followers to mirror on their shards."""

    kind: str  # release | resume | replaced
    tags: tuple = ()


def _check_tags(what: str, tags, default) -> list[str]:
    """``tags`` (a list, one tag as a string, or None for ``default``) in MEMORY_TAGS order,
    each once; ValueError naming an unknown tag."""
    tags = default if tags is None else [tags] if isinstance(tags, str) else list(tags)
    for tag in tags:
        if tag not in MEMORY_TAGS:
            raise ValueError(f"{what}: unknown tag {tag!r}; the tags are {list(MEMORY_TAGS)}")
    return [t for t in MEMORY_TAGS if t in tags]



class MemorySaver:
    """Frees and restores the memory behind the KV pool and the model's weights.

    ``released`` is the set of released tags: the scheduler's ``memory_released``
    (``continue_generation`` refuses while it is not empty).
    """

    def __init__(self, runner, scheduler):
        self.runner = runner
        self.scheduler = scheduler
        self.released: set[str] = scheduler.memory_released
        self.storages = StorageSaver(runner, self.released)

    # ---- public ------------------------------------------------------------------------
    def release(self, tags: list[str] | str | None) -> dict:
        """Free the memory of ``tags`` (None: both) while generation is paused.

        ValueError, with nothing changed, for an unknown or already released tag, when
        generation is not paused, or (``kv_cache``) while paused requests hold KV
        (``in_place``). ``kv_cache`` flushes the radix cache and drops the KV content;
        ``weights`` spill their bytes first and get them back on :meth:`resume`.
        Returns ``{"tags", "bytes" (freed), "seconds", "released" (all released now)}``.
        """
        tags = _check_tags("release_memory_occupation", tags, default=MEMORY_TAGS)
        for tag in tags:
            if tag in self.released:
                raise ValueError(f"release_memory_occupation: {tag!r} is already released")
        s = self.scheduler
        if s.paused is None:
            raise ValueError("release_memory_occupation needs generation paused: "
                             "call pause_generation first")
        if "kv_cache" in tags:
            holders = s.num_holding_kv
            rows = s.kv.req_pool.max_requests - s.kv.req_pool.available_size()
            if holders or rows:
                raise ValueError(
                    f"release_memory_occupation(['kv_cache']): {max(holders, rows)} paused "
                    f"request(s) hold KV (pause mode {s.paused!r} keeps it); call "
                    "pause_generation(mode='retract') or pause_generation(mode='abort') first")
        t0 = time.perf_counter()
        if "kv_cache" in tags:
            self._flush_kv()
        state = self.storages.release(tags)
        self.runner.weights_moved()  # captured decode graphs read the freed storages
        self._relay(MemoryOp("release", tuple(tags)))
        return self._report("release_memory_occupation", "freed", tags, state, t0)

    def resume(self, tags: list[str] | str | None) -> dict:
        """Allocate the memory of released ``tags`` again (None: every released tag).

        ``weights`` get their bytes back (and the spill file is deleted); ``kv_cache``
        comes back zero-filled with every slot free. ValueError, with nothing changed,
        for an unknown tag or one that is not released; if allocating fails (out of
        memory) the tags stay released. Same return shape as :meth:`release`.
        """
        tags = _check_tags("resume_memory_occupation", tags, default=self.released)
        for tag in tags:
            if tag not in self.released:
                raise ValueError(f"resume_memory_occupation: {tag!r} is not released")
        t0 = time.perf_counter()
        state = self.storages.resume(tags)
        self.runner.weights_moved()  # new storages: decode graphs are captured again
        self._relay(MemoryOp("resume", tuple(tags)))
        if "kv_cache" in tags:
            kv = self.scheduler.kv
            if kv.allocator.available_size() == kv.pool_size and kv.cache.total_size() == 0:
                kv.allocator.reset()  # every slot free again, in address order
            self.scheduler.check_kv_conservation()
        return self._report("resume_memory_occupation", "restored", tags, state, t0)

    def replaced(self) -> bool:
        """A full weight update replaced the released weights: see
        :meth:`StorageSaver.replaced` (on every tensor-parallel rank)."""
        done = self.storages.replaced()
        if done:
            self._relay(MemoryOp("replaced", ()))
        return done

    def _relay(self, op) -> None:
        """Tensor parallelism: the followers free and restore their shards' memory too."""
        if self.runner.tp.size > 1:
            self.runner.tp.send(op)

    # ---- internals ---------------------------------------------------------------------
    def _flush_kv(self) -> None:
        """Empty the radix cache (no request holds KV: checked by the caller), so every slot
        is free and the KV pool's storages may go."""
        s = self.scheduler
        s.check_kv_conservation()
        if not s.kv.flush_cache():
            raise AssertionError("flush_cache failed with no request holding KV")
        s.check_kv_conservation()
        if s.kv.allocator.available_size() != s.kv.pool_size:
            raise AssertionError("KV slots are held after flushing the cache")

    def _report(self, what: str, verb: str, tags: list[str], state, t0: float) -> dict:
        nbytes = sum(rel.nbytes for rel in state)
        seconds = time.perf_counter() - t0
        logger.info("%s(%s): %s %.1f MiB in %.2f s; released now: %s", what, tags, verb,
                    nbytes / 2**20, seconds, sorted(self.released))
        return {"tags": list(tags), "bytes": nbytes, "seconds": seconds,
                "released": sorted(self.released)}
