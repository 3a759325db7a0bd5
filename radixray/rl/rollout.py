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
from radixray.rl.multi_turn import is_multi_turn, run_episode, token_versions
from radixray.rl.tasks import Problem

logger = logging.getLogger("radixray.rl")


class RolloutFailed(RuntimeError):
    """A group could not be sampled on any worker."""


@dataclass
class Sample:
    prompt_ids: list[int]
    output_ids: list[int]  # every token after the prompt (a tool episode's included)
    logprobs: list[float]  # per output token; 0 where loss_mask is 0
    text: str  # what the reward scores (a tool episode: the model's turns)
    weight_version: int | str  # the weights that produced its last token (an int or a label)
    worker_id: str
    cached_tokens: int  # of its (first) request
    finish_reason: str
    loss_mask: list[int] | None = None  # per output token, 1 = trained on; None = all
    token_versions: list | None = None  # per output token, the weights that produced it
    turns: list[dict] | None = None  # a tool episode's model turns (cached_tokens, ...)
    # MoE models: [token][MoE layer][k] expert ids of positions routed_experts_start.. (the
    # rollout's routing, replayed by the trainer: radixray.rl.routing_replay)
    routed_experts: list | None = None
    routed_experts_start: int = 0

    def oldest_version(self):
        """The oldest weights that produced one of its trained tokens (an int, or a label)."""
        versions = self.token_versions or [self.weight_version]
        mask = self.loss_mask or [1] * len(versions)
        trained = [v for v, m in zip(versions, mask) if m] or [self.weight_version]
        ints = [v for v in trained if isinstance(v, int)]
        return min(ints) if len(ints) == len(trained) else trained[0]

    def trainer_dict(self, advantage: float) -> dict:
        """The sample as the trainer takes it."""
        out = {"prompt_ids": self.prompt_ids, "output_ids": self.output_ids,
               "logprobs": self.logprobs, "advantage": advantage}
        if self.loss_mask is not None:
            out["loss_mask"] = self.loss_mask
        if self.routed_experts:
            out["routed_experts"] = self.routed_experts
            out["routed_experts_start"] = self.routed_experts_start
        return out


@dataclass
class Group:
    problem: Problem
    samples: list[Sample]


MAX_RESUMES = 16  # a request aborted more often than this (by weight updates) fails


@dataclass
class RolloutContext:
    """What a rollout function gets: the group's worker (``generate``), the tokenizer and
    the task. Every request of a group goes to this one worker (its radix cache holds the
    group's prompt and, across turns, each conversation so far).

    With ``resume_aborted`` (the fleet pauses with ``abort`` at weight updates) a request
    that a weight update aborted is submitted again from its tokens (prompt + what it had
    generated, for the tokens it has left) and the pieces come back as one result whose
    ``weight_versions`` spans say which weights produced which tokens."""

    handle: object  # the worker actor
    worker_id: str
    tokenizer: object
    task: object
    priority: int = 0
    resume_aborted: bool = False

    async def generate(self, input_ids: list[int], params: dict) -> dict:
        """One request on the group's worker; the engine's result (``meta_info.worker_id``
        set)."""
        [out] = await self.handle.generate_group.remote(input_ids, 1, [params], self.priority)
        return await self._resumed(input_ids, params, out)

    async def generate_n(self, input_ids: list[int], n: int, params: list[dict]) -> list[dict]:
        """``n`` samples of one prompt in one batch (the prompt is prefilled once)."""
        outs = await self.handle.generate_group.remote(input_ids, n, params, self.priority)
        return list(await asyncio.gather(*(self._resumed(input_ids, p, o)
                                           for p, o in zip(params, outs))))

    async def _resumed(self, input_ids: list[int], params: dict, out: dict) -> dict:
        for _ in range(MAX_RESUMES):
            if not self.resume_aborted or not _aborted(out):
                return out
            left = params.get("max_new_tokens", 128) - len(out["output_ids"])
            if left <= 0:
                out["meta_info"]["finish_reason"] = {"type": "length", "length": len(out["output_ids"])}
                return out
            [more] = await self.handle.generate_group.remote(
                list(input_ids) + list(out["output_ids"]), 1, [{**params, "max_new_tokens": left}],
                self.priority)
            out = join_outputs(out, more)
        raise RolloutFailed(f"a request was aborted more than {MAX_RESUMES} times")


def _aborted(out: dict) -> bool:
    return ((out["meta_info"].get("finish_reason") or {}).get("type")) == "abort"


def join_outputs(first: dict, second: dict) -> dict:
    """One result from a request and its resumption (``second`` continued ``first``'s
    tokens): outputs and logprobs concatenated, version spans joined, the second's finish."""
    n1 = len(first["output_ids"])
    spans = []
    for meta, offset, n in ((first["meta_info"], 0, n1),
                            (second["meta_info"], n1, len(second["output_ids"]))):
        for k, v in enumerate(token_versions(meta, n)):
            if spans and spans[-1]["weight_version"] == v:
                spans[-1]["end"] = offset + k + 1
            else:
                spans.append({"weight_version": v, "start": offset + k, "end": offset + k + 1})
    meta = {**first["meta_info"], **{k: second["meta_info"][k] for k in (
        "finish_reason", "weight_version", "routed_experts", "routed_experts_start")
        if k in second["meta_info"]}}
    meta["completion_tokens"] = n1 + len(second["output_ids"])
    meta["resumed"] = first["meta_info"].get("resumed", 0) + 1
    if len(spans) > 1:
        meta["weight_versions"] = spans
    out = {**first, "output_ids": list(first["output_ids"]) + list(second["output_ids"]),
           "meta_info": meta}
    if "output_token_logprobs" in first:
        out["output_token_logprobs"] = (list(first["output_token_logprobs"] or [])
                                        + list(second.get("output_token_logprobs") or []))
    return out


def check_output(out: dict) -> dict:
    """``out``'s meta_info; RolloutFailed if the engine reported an error for it."""
    meta = out["meta_info"]
    reason = meta["finish_reason"] or {}
    if reason.get("type") == "error":
        raise RolloutFailed(f"a sample failed on {meta.get('worker_id')}: {reason}")
    return meta


def prompt_ids(tokenizer, problem: Problem) -> list[int]:
    """The problem as a one-turn chat in the model's template, ready for the answer."""
    messages = [{"role": "user", "content": problem.prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(problem.prompt)


async def single_turn(ctx: RolloutContext, problem: Problem, n: int,
                      params: list[dict]) -> list[Sample]:
    """The default rollout of a one-turn task: ``n`` answers to the problem as one batch."""
    ids = prompt_ids(ctx.tokenizer, problem)
    samples = []
    for out in await ctx.generate_n(ids, n, params):
        meta = check_output(out)
        samples.append(Sample(
            prompt_ids=ids, output_ids=list(out["output_ids"]),
            logprobs=list(out.get("output_token_logprobs") or []),
            text=ctx.tokenizer.decode(out["output_ids"], skip_special_tokens=True),
            weight_version=meta["weight_version"], worker_id=meta["worker_id"],
            cached_tokens=meta["cached_tokens"],
            finish_reason=(meta["finish_reason"] or {}).get("type", ""),
            token_versions=token_versions(meta, len(out["output_ids"])),
            routed_experts=meta.get("routed_experts"),
            routed_experts_start=meta.get("routed_experts_start") or 0))
    return samples


async def multi_turn(ctx: RolloutContext, problem: Problem, n: int,
                     params: list[dict]) -> list[Sample]:
    """The default rollout of a tool task: ``n`` episodes (:mod:`radixray.rl.multi_turn`),
    run concurrently on the group's worker."""
    async def generate(ids, p):
        out = await ctx.generate(ids, p)
        check_output(out)
        return out

    episodes = await asyncio.gather(*(
        run_episode(generate, ctx.tokenizer, ctx.task.environment(problem), p) for p in params))
    return [Sample(prompt_ids=e["prompt_ids"], output_ids=e["output_ids"],
                   logprobs=e["logprobs"], text=e["text"],
                   weight_version=e["turns"][-1]["weight_version"], worker_id=ctx.worker_id,
                   cached_tokens=e["turns"][0]["cached_tokens"], finish_reason=e["finish_reason"],
                   loss_mask=e["loss_mask"], token_versions=e["token_versions"],
                   turns=e["turns"], routed_experts=e["routed_experts"],
                   routed_experts_start=e["routed_experts_start"])
            for e in episodes]


def default_rollout_function(task):
    """:func:`multi_turn` for a tool task, else :func:`single_turn`."""
    return multi_turn if is_multi_turn(task) else single_turn


class RolloutManager:
    """Samples groups through ``controller`` (worker handles) and ``router`` (placement).
    ``rollout_function(ctx, problem, n, params) -> list[Sample]`` runs one group on the
    worker in ``ctx`` (default: by the task's kind)."""

    def __init__(self, controller, router, tokenizer, sampling: dict, priority: int = 0,
                 max_attempts: int = 3, task=None, rollout_function=None,
                 resume_aborted: bool = False):
        self.controller = controller
        self.router = RouterClient(router)
        self.tokenizer = tokenizer
        self.sampling = {**sampling, "return_logprob": True, "return_unscaled_logprob": True}
        self.priority = priority
        self.max_attempts = max_attempts
        self.task = task
        self.rollout_function = rollout_function or default_rollout_function(task)
        self.resume_aborted = resume_aborted

    async def rollout(self, problems: list[Problem], n: int, seed: int | None = None,
                      sampling: dict | None = None) -> list[Group]:
        """One group of ``n`` samples per problem, all groups at once. ``seed`` makes each
        sample's sampling reproducible (sample j of group i gets ``seed + i * n + j``)."""
        return list(await asyncio.gather(*(
            self.group(p, n, None if seed is None else seed + i * n, sampling)
            for i, p in enumerate(problems))))

    async def group(self, problem: Problem, n: int, seed: int | None,
                    sampling: dict | None) -> Group:
        """One group of ``n`` samples of ``problem`` on one worker (``seed``: sample j gets
        ``seed + j``), resampled whole elsewhere if its worker fails."""
        params = {**self.sampling, **(sampling or {})}
        per_sample = [params if seed is None else {**params, "seed": seed + j} for j in range(n)]
        key = problem.prompt  # the router's affinity key: one problem, one worker
        excluded: list[str] = []
        errors: list[str] = []
        for attempt in range(self.max_attempts):
            worker, _ = await self.router.pick(key, None, excluded, attempt > 0)
            try:
                entry = await self.controller.worker.remote(worker)
                ctx = RolloutContext(entry.handle, worker, self.tokenizer, self.task,
                                     self.priority, self.resume_aborted)
                group = Group(problem, await self.rollout_function(ctx, problem, n, per_sample))
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
