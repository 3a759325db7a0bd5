"""Turning user prompts and parameters into validated requests.

All checks run for the whole call before anything is scheduled, so one bad
prompt in a batch rejects the call and leaves the engine untouched.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from radixray.engine.grammar.spec import spec_of
from radixray.engine.request import Req
from radixray.engine.request_ids import choice_rids
from radixray.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_len: int
    max_total_tokens: int
    moe: bool = False  # the model routes tokens to experts (return_routed_experts allowed)
    # why this engine refuses structured output (json_schema, regex, ebnf, structural_tag); None: it takes it
    no_structured_output: str | None = None
    # why this engine refuses prompt logprobs (logprob_start_len >= 0); None: it takes them
    no_prompt_logprobs: str | None = None


def normalize_prompts(prompt, input_ids) -> tuple[list, bool]:
    """Return (list of prompts, each str or list[int]; whether the call was a batch)."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt (text) or input_ids (token ids)")
    if prompt is not None:
        if isinstance(prompt, str):
            return [prompt], False
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            if not prompt:
                raise ValueError("prompt must not be an empty list")
            return list(prompt), True
        raise ValueError("prompt must be a string or a list of strings")
    if isinstance(input_ids, list) and input_ids and all(isinstance(t, list) for t in input_ids):
        return list(input_ids), True
    if isinstance(input_ids, list):
        return [input_ids], False
    raise ValueError("input_ids must be a list of ints or a list of lists of ints")


def _per_prompt(value, n: int, name: str) -> list:
    """Broadcast one value to every prompt, or check a per-prompt list's length."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def to_sampling_params(value) -> SamplingParams:
    if isinstance(value, SamplingParams):
        return value
    if value is None or isinstance(value, dict):
        return SamplingParams.from_dict(value)
    raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}")


def check_token_ids(ids, limits: Limits, index: int) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"input_ids[{index}] must be a list of ints")
    if not ids:
        raise ValueError(f"prompt {index} is empty: at least 1 token is required")
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ValueError(f"input_ids[{index}] contains token id {bad}, outside the vocabulary "
                         f"[0, {limits.vocab_size})")
    if len(ids) >= limits.context_len:
        raise ValueError(f"prompt {index} has {len(ids)} tokens; it must be shorter than the "
                         f"context length {limits.context_len}")
    if len(ids) + 1 > limits.max_total_tokens:
        raise ValueError(f"prompt {index} needs {len(ids) + 1} KV slots but the pool holds "
                         f"max_total_tokens={limits.max_total_tokens}")
    return ids


def check_logprob_start(sp: SamplingParams, prompt_len: int, limits: Limits, index: int) -> None:
    """With return_logprob, ``logprob_start_len`` names a prompt position (or is -1)."""
    start = sp.logprob_start_len
    if not sp.return_logprob or start < 0:
        return
    if limits.no_prompt_logprobs:
        raise ValueError(f"logprob_start_len: prompt logprobs are not available here: "
                         f"{limits.no_prompt_logprobs}")
    if start >= prompt_len:
        raise ValueError(f"logprob_start_len ({start}) must be less than the length of prompt "
                         f"{index} ({prompt_len} tokens)")


def check_adapters(lora_path, n: int, adapters) -> list[tuple[str | None, int, int | str]]:
    """Each prompt's (adapter name or None, radix-cache namespace, adapter version):
    ``lora_path`` is one
    adapter name for every prompt, one per prompt, or None. ``adapters``: the engine's
    LoraSlots (``namespace``, ``adapters``), None without LoRA. ValueError naming the adapter
    when it is not loaded."""
    out = []
    for name in _per_prompt(lora_path, n, "lora_path"):
        if name is None:
            out.append((None, 0, 0))
            continue
        if not isinstance(name, str):
            raise ValueError(f"lora_path must be an adapter name (a string), got {name!r}")
        if adapters is None:
            raise ValueError(f"lora_path: unknown LoRA adapter {name!r}: this engine serves "
                             "no adapters (start it with lora_paths or enable_lora)")
        ns = adapters.namespace(name)
        if ns is None:
            raise ValueError(f"lora_path: unknown LoRA adapter {name!r}; loaded adapters: "
                             f"{sorted(adapters.adapters())}")
        out.append((name, ns, adapters.version(name)))
    return out


def build_requests(prompt, input_ids, sampling_params, tokenizer, limits: Limits,
                   rid=None, priority=None, lora_path=None,
                   adapters=None) -> tuple[list[Req], bool]:
    """Validate everything, then build one Req per prompt. Raises ValueError naming the field.
    ``rid``: one id (a batch runs as ``rid_0``, ``rid_1``, ...: engine/request_ids.py), one
    per prompt, or None (fresh ids). ``lora_path``: see :func:`check_adapters`."""
    prompts, is_batch = normalize_prompts(prompt, input_ids)
    n = len(prompts)
    loras = check_adapters(lora_path, n, adapters)
    params = [to_sampling_params(p) for p in _per_prompt(sampling_params, n, "sampling_params")]
    for p in params:
        p.validate(limits.vocab_size)
        if p.return_routed_experts and not limits.moe:
            raise ValueError("return_routed_experts needs a mixture-of-experts model; this "
                             "model has no routed experts")
        if limits.no_structured_output and spec_of(p) is not None:
            raise ValueError(f"{spec_of(p).field}: structured output is not available here: "
                             f"{limits.no_structured_output}")
    # one id for a batch names it as a whole: its prompts run as rid_0, rid_1, ...
    rids = choice_rids(rid, n) if isinstance(rid, str) else _per_prompt(rid, n, "rid")
    given = [r for r in rids if r is not None]
    if len(set(given)) != len(given):
        raise ValueError("rid must be unique per prompt: give a list of distinct ids for a batch")
    priorities = _per_prompt(priority, n, "priority")
    reqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if isinstance(p, str):
            if not p:
                raise ValueError(f"prompt {i} is empty: at least 1 character is required")
            ids = tokenizer.encode(p, add_special_tokens=True)
        else:
            ids = p
        ids = check_token_ids(ids, limits, i)
        check_logprob_start(sp, len(ids), limits, i)
        prio = priorities[i] if priorities[i] is not None else 0
        if not isinstance(prio, int):
            raise ValueError(f"priority must be an integer, got {prio!r}")
        reqs.append(Req(rid=rids[i] or uuid.uuid4().hex, prompt_ids=list(ids), sampling=sp,
                        priority=prio, lora=loras[i][0], lora_ns=loras[i][1],
                        lora_version=loras[i][2]))
    return reqs, is_batch


def attach_bootstrap(reqs: list[Req], bootstrap) -> None:
    """Give each request its PDBootstrap (one for all, or a list with one per request)."""
    if bootstrap is None:
        return
    items = bootstrap if isinstance(bootstrap, list) else [bootstrap] * len(reqs)
    if len(items) != len(reqs):
        raise ValueError(f"bootstrap: {len(items)} given for {len(reqs)} prompts")
    if len({b.room for b in items}) != len(items):
        raise ValueError("bootstrap: every prompt needs its own bootstrap room")
    for req, b in zip(reqs, items):
        req.pd = b
