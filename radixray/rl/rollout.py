"""Rollouts through the fleet: ``n`` samples per problem, every sample of a group on one worker.

The router picks a worker for each group by the prompt's text (cache_aware: the
worker that saw it, else the least loaded), and the worker runs the group as one
batch (``EngineWorker.generate_group``), so the prompt is prefilled once and the other
``n - 1`` samples reuse its KV. Every sample comes back with its tokens, the engine's
unscaled logprobs (the "old policy" of the GRPO ratio), the weight version(s) that
produced it and the worker that ran it.

A group whose worker fails (died, draining, engine failed) runs again, whole, on
another worker (up to ``max_attempts``); a step never trains on part of a group. If
every attempt fails the rollout raises :class:`RolloutFailed`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from radixray.cluster.errors import unwrap_ray_error
from radixray.cluster.router_client import RouterClient
from radixray.rl.tasks import Problem

logger = logging.getLogger("radixray.rl")


class RolloutFailed(RuntimeError):
    """A group could not be sampled on any worker."""


@dataclass
class Sample:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    text: str
    weight_version: int | str  # the weights that produced its last token (an int or a label)
    worker_id: str
    cached_tokens: int
    finish_reason: str


@dataclass
class Group:
    problem: Problem
    samples: list[Sample]


class RolloutManager:
    """Samples groups through ``controller`` (worker handles) and ``router`` (placement)."""

    def __init__(self, controller, router, tokenizer, sampling: dict, priority: int = 0,
                 max_attempts: int = 3):
        self.controller = controller
        self.router = RouterClient(router)
        self.tokenizer = tokenizer
        self.sampling = {**sampling, "return_logprob": True, "return_unscaled_logprob": True}
        self.priority = priority
        self.max_attempts = max_attempts

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The problem as a one-turn chat in the model's template, ready for the answer."""
        messages = [{"role": "user", "content": problem.prompt}]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(problem.prompt)

    async def rollout(self, problems: list[Problem], n: int, seed: int | None = None,
                      sampling: dict | None = None) -> list[Group]:
        """One group of ``n`` samples per problem, all groups at once. ``seed`` makes each
        sample's sampling reproducible (sample j of group i gets ``seed + i * n + j``)."""
        return list(await asyncio.gather(*(
            self._group(p, n, None if seed is None else seed + i * n, sampling)
            for i, p in enumerate(problems))))

    async def _group(self, problem: Problem, n: int, seed: int | None,
                     sampling: dict | None) -> Group:
        ids = self.prompt_ids(problem)
        params = {**self.sampling, **(sampling or {})}
        per_sample = params if seed is None else [{**params, "seed": seed + j} for j in range(n)]
        text = self.tokenizer.decode(ids)
        excluded: list[str] = []
        errors: list[str] = []
        for attempt in range(self.max_attempts):
            worker, _ = await self.router.pick(text, None, excluded, attempt > 0)
            try:
                entry = await self.controller.worker.remote(worker)
                outs = await entry.handle.generate_group.remote(ids, n, per_sample, self.priority)
                group = Group(problem, [self._sample(ids, out) for out in outs])
            except Exception as exc:  # noqa: BLE001 - the whole group goes to another worker
                self.router.release(worker, False)
                excluded.append(worker)
                errors.append(f"{worker}: {unwrap_ray_error(exc)}")
                logger.warning("rollout group failed on %s, resampling it elsewhere: %s",
                               worker, errors[-1])
                continue
            self.router.release(worker, True)
            return group
        raise RolloutFailed(f"a group could not be sampled ({self.max_attempts} attempts): "
                            + "; ".join(errors))

    def _sample(self, ids: list[int], out: dict) -> Sample:
        meta = out["meta_info"]
        reason = meta["finish_reason"] or {}
        if reason.get("type") == "error":
            raise RolloutFailed(f"a sample failed on {meta.get('worker_id')}: {reason}")
        return Sample(prompt_ids=ids, output_ids=list(out["output_ids"]),
                      logprobs=list(out.get("output_token_logprobs") or []),
                      text=self.tokenizer.decode(out["output_ids"], skip_special_tokens=True),
                      weight_version=meta["weight_version"], worker_id=meta["worker_id"],
                      cached_tokens=meta["cached_tokens"], finish_reason=reason.get("type", ""))
