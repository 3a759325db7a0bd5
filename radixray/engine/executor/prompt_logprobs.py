"""Prompt-token logprobs (SGLang's ``input_token_logprobs``) computed during prefill.

Contract, as SGLang's: a request with ``return_logprob`` reports one entry per prompt
position from ``s = Req.input_logprob_start`` (``logprob_start_len``; -1 means the last
prompt token) to the end of the prompt. Entry 0 has no logprob (None), whatever ``s``: the
logits that would give it belong to position ``s - 1``, which is not computed. Entry
``i > 0`` is ``log_softmax(logits[s + i - 1])[prompt[s + i]]``: the logprob of prompt token
``s + i`` after the tokens before it, of the model's raw distribution (never scaled by the
temperature or changed by penalties or grammars), fp32. With ``top_logprobs_num`` k > 0
each entry also gets its k most likely tokens (None for entry 0).

How: an extend batch that carries positions ``s .. len(prompt) - 2`` of such a request asks
the model for those rows' final hidden states besides each request's last
(:class:`PromptLogprobRows`); :func:`compute_prompt_logprobs` projects them to logits
``LOGIT_CHUNK_BYTES`` at a time (a prompt's ``[rows, vocab]`` logits are never held whole),
and appends the values to ``Req.input_logprobs`` chunk by chunk of a chunked prefill.

Radix cache: a cached prefix is recomputed, not kept. While a request's prompt logprobs are
pending its prefix match stops at the first position whose logits they need
(``Req.prefix_limit``, SGLang's rule), so those positions run through the model again;
the cache holds KV, never logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixray.engine.executor.sampler import log_probs
from radixray.engine.request import Req

# Most bytes of fp32 logits one projection chunk holds (the log-softmax doubles it).
LOGIT_CHUNK_BYTES = 64 * 2**20


@dataclass
class PromptLogprobRows:
    """The rows of one extend batch whose next-token logprobs are prompt logprobs.

    ``rows``: their indices among the batch's packed tokens; ``targets``: the prompt token
    each row's logits are scored at (the next one); ``owners``: each request and how many
    consecutive rows of ``rows`` are its, in order. The model fills ``hidden`` (final
    normed hidden states, ``[len(rows), hidden]``) in the forward pass.
    """

    rows: torch.Tensor
    targets: torch.Tensor
    owners: list[tuple[Req, int]]
    hidden: torch.Tensor | None = None


def no_prompt_logprobs(config) -> str | None:
    """Why an engine with ``config`` (EngineConfig) refuses prompt logprobs; None if it
    computes them. A prefill-decode pair does not: the prefill side sees the prompt, the
    decode side answers the request, and nothing carries the values between them."""
    if config.disaggregation_mode is not None:
        return (f"a {config.disaggregation_mode} worker of a prefill-decode pair does not "
                "return them (serve them from unified workers)")
    return None


def plan_prompt_rows(items: list[tuple[Req, int]]) -> PromptLogprobRows | None:
    """For an extend batch of ``items`` (request, new tokens after its ``kv_len``), the rows
    whose logits give pending prompt logprobs; None when no request needs any."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[Req, int]] = []
    offset = 0
    for req, n in items:
        if req.input_logprobs_pending:
            first = req.input_logprob_start + len(req.input_logprobs)
            if req.kv_len > first:  # Req.prefix_limit keeps the match at or before it
                raise RuntimeError(f"request {req.rid}: prompt logprobs need position {first} "
                                   f"but its KV already covers {req.kv_len} tokens")
            lo, hi = first, min(req.kv_len + n, len(req.prompt_ids) - 1)
            if hi > lo:
                rows.extend(range(offset + lo - req.kv_len, offset + hi - req.kv_len))
                targets.extend(req.prompt_ids[lo + 1:hi + 1])
                owners.append((req, hi - lo))
        offset += n
    if not owners:
        return None
    return PromptLogprobRows(torch.tensor(rows, dtype=torch.int64),
                             torch.tensor(targets, dtype=torch.int64), owners)


def projection_chunks(rows: int, vocab_size: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` row ranges projected at a time (``LOGIT_CHUNK_BYTES`` of logits
    each); a tensor-parallel follower projects the same ones."""
    step = max(1, LOGIT_CHUNK_BYTES // (4 * vocab_size))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


@torch.inference_mode()
def compute_prompt_logprobs(plan: PromptLogprobRows,
                            project: Callable[[torch.Tensor], torch.Tensor],
                            vocab_size: int) -> None:
    """Append each owner's prompt logprobs (and top logprobs when it asked for k > 0) from
    ``plan.hidden``; ``project`` maps hidden states to fp32 logits ``[rows, vocab_size]``
    (the model's lm_head). At most ``LOGIT_CHUNK_BYTES`` of logits exist at a time."""
    hidden = plan.hidden
    if hidden is None:
        raise RuntimeError("the model did not keep the prompt rows' hidden states")
    targets = plan.targets.to(hidden.device)
    k_max = min(max(req.sampling.top_logprobs_num for req, _ in plan.owners), vocab_size)
    chosen: list[float] = []
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    for start, stop in projection_chunks(hidden.shape[0], vocab_size):
        lp = log_probs(project(hidden[start:stop]).float())
        chosen.extend(lp.gather(1, targets[start:stop].unsqueeze(1)).squeeze(1).tolist())
        if k_max:
            vals, idx = lp.topk(k_max, dim=-1, sorted=True)
            top_vals.extend(vals.tolist())
            top_ids.extend(idx.tolist())
    at = 0
    for req, count in plan.owners:
        req.input_logprobs.extend(chosen[at:at + count])
        k = req.sampling.top_logprobs_num
        if k:
            req.input_top_logprobs.extend(list(zip(top_ids[j][:k], top_vals[j][:k], strict=True))
                                          for j in range(at, at + count))
        at += count


def input_logprob_entries(req: Req) -> tuple[list[float | None], list | None]:
    """A finished prefill's prompt logprobs as reported: one value per prompt position from
    ``input_logprob_start`` (None first), and with top logprobs asked, one list of
    (token, logprob) per position (None first); else None."""
    values: list[float | None] = [None, *req.input_logprobs]
    tops = [None, *req.input_top_logprobs] if req.sampling.top_logprobs_num else None
    return values, tops
