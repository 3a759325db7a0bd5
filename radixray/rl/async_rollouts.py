"""Asynchronous GRPO: rollouts keep going while the trainer trains, at most ``max_staleness``
weight versions behind it.

:class:`AsyncBatches` runs the rollouts in a background thread with its own event loop.
Group ``i`` is problem ``i`` of the same seeded stream the synchronous loop walks (step
``i // prompts_per_step``, same sampling seeds), so the two loops see the same problems.
The trainer takes the first ``prompts_per_step`` groups to *finish*.

Staleness is bounded twice:

- a gate on starting groups (AReaL's rule): while the trainer is at step ``t``, at most
  ``(t + max_staleness + 1) * prompts_per_step`` groups (plus those thrown away) may have
  been started, so a group starts at most ``max_staleness`` versions before the one that
  trains on it;
- a check on taking them: a group with a trained token older than ``version -
  max_staleness`` (it ran long, or waited) is dropped, never trained on.

Weight updates do not wait for the rollouts. What happens to a request in flight is the
job's ``pause_mode``: ``in_place`` (default for async) keeps its KV and continues with the
new weights, ``retract`` recomputes its KV under the new weights, keeping its tokens;
either way its tokens carry ``weight_versions`` spans (a partial rollout). ``abort`` ends
it, and the rollout submits it again from its tokens (:class:`~radixray.rl.rollout.RolloutContext`).
The loss then corrects for the behaviour policy (``loss_correction: tis``, see
:func:`~radixray.rl.grpo_loss.grpo_loss`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from radixray.rl.batches import Batch, is_flat, make_batch, problem_seed, sample_seed

logger = logging.getLogger("radixray.rl")


class AsyncBatches:
    """Batches from rollouts that run ahead of the trainer; see the module docstring."""

    def __init__(self, job, cfg, reward):
        self.job, self.cfg, self.reward = job, cfg, reward
        self.version = job.weight_version()  # the policy the trainer trains next
        self.trained = 0  # steps whose weights reached the fleet
        self._cond = threading.Condition()
        self._ready: list[tuple] = []  # (group, rewards) in the order they finished
        self._error: BaseException | None = None
        self._started = 0
        self._discarded = 0  # groups thrown away (stale or flat): replaced, not counted
        self._problems: dict[int, list] = {}
        self._in_flight = 0
        self._idle_since: float | None = time.perf_counter()
        self._idle_s = 0.0
        self._stop = False
        self._loop = asyncio.new_event_loop()
        self._wake = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._produce(),), name="grpo-rollouts",
                                        daemon=True)
        self._thread.start()

    # ---- the rollout side (the background loop) -----------------------------------------
    def _budget(self) -> int:
        """How many groups may have been started by now."""
        return ((self.trained + self.cfg.max_staleness + 1) * self.cfg.prompts_per_step
                + self._discarded)

    async def _produce(self) -> None:
        tasks: set[asyncio.Task] = set()
        while not self._stop:
            with self._cond:
                room = self._started < self._budget()
            if not room:
                self._wake.clear()
                with self._cond:  # check again: a wake may have come before the clear
                    room = self._started < self._budget() or self._stop
                if not room:
                    await self._wake.wait()
                continue
            i = self._started
            self._started += 1
            task = asyncio.create_task(self._one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, i: int) -> None:
        cfg = self.cfg
        step, j = divmod(i, cfg.prompts_per_step)
        if step not in self._problems:
            self._problems[step] = self.job.task.problems(cfg.prompts_per_step,
                                                          seed=problem_seed(cfg, step))
        problem = self._problems[step][j]
        self._busy(+1)
        try:
            group = await self.job.rollouts.group(
                problem, cfg.group_size, sample_seed(cfg, step) + j * cfg.group_size, None)
            rewards = [self.reward(s.text, problem) for s in group.samples]
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the trainer's side raises it
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            return
        finally:
            self._busy(-1)
        with self._cond:
            self._ready.append((group, rewards))
            self._cond.notify_all()

    def _busy(self, delta: int) -> None:
        """Count groups in flight; time with none in flight is rollout idle time."""
        now = time.perf_counter()
        with self._cond:
            if self._in_flight == 0 and self._idle_since is not None:
                self._idle_s += now - self._idle_since
                self._idle_since = None
            self._in_flight += delta
            if self._in_flight == 0:
                self._idle_since = now

    def _wake_producer(self) -> None:
        self._loop.call_soon_threadsafe(self._wake.set)

    # ---- the trainer side (the driver's thread) -----------------------------------------
    def next(self, step: int) -> Batch:
        """The next ``prompts_per_step`` groups fresh enough for the trainer's version
        (blocks until they finished); raises the rollouts' error if one failed."""
        cfg = self.cfg
        t0 = time.perf_counter()
        kept, rewards = [], []
        stale = flat = 0
        with self._cond:
            while len(kept) < cfg.prompts_per_step:
                if self._error is not None:
                    raise self._error
                if not self._ready:
                    self._cond.wait(timeout=1.0)
                    continue
                group, row = self._ready.pop(0)
                oldest = [s.oldest_version() for s in group.samples]
                if all(isinstance(v, int) for v in oldest) and \
                        self.version - min(oldest) > cfg.max_staleness:
                    stale += 1
                elif cfg.dynamic_sampling and is_flat(row) and \
                        flat < cfg.dynamic_sampling_max_rounds * cfg.prompts_per_step:
                    flat += 1
                else:
                    kept.append(group)
                    rewards.append(row)
                    continue
                self._discarded += 1
                self._wake_producer()
        waited = time.perf_counter() - t0
        metrics = {"trainer_wait_s": waited, "groups_dropped_stale": stale,
                   "rollouts_in_flight": self._in_flight}
        if cfg.dynamic_sampling:
            metrics["groups_dropped_flat"] = flat
        return make_batch(kept, rewards, cfg.scale_advantages, self.version, **metrics)

    def synced(self, version) -> None:
        """The trainer's weights are now ``version`` on every worker: one more step may be
        sampled ahead."""
        with self._cond:
            self.version = version
            self.trained += 1
        self._wake_producer()

    def idle(self, wall_s: float) -> dict:
        with self._cond:
            idle = self._idle_s + (time.perf_counter() - self._idle_since
                                   if self._idle_since is not None else 0.0)
        return {"rollout_idle_frac": min(1.0, idle / wall_s)}

    def close(self) -> None:
        """Stop starting groups and cancel those in flight (their requests end on the
        workers); waits for the background loop to finish. Idempotent."""
        if self._stop:
            return
        self._stop = True
        self._wake_producer()
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            logger.warning("the rollout thread did not stop within 60 s")
        else:
            self._loop.close()
