"""Multi-turn episodes, token in and token out: generate, run the tool, append, continue.

One episode of a :class:`~radixray.rl.tool_tasks.ToolTask` is one sample. Its token ids
only ever grow: turn ``k + 1``'s input is exactly turn ``k``'s input, plus the tokens the
model generated, plus the tokens of what the environment said (the rest of the assistant
message's template, the tool's message, the next assistant header). Nothing already
generated is decoded and tokenized again, so the trainer scores the very tokens the model
sampled (re-tokenizing a conversation can merge or split tokens differently and shift every
logprob after the change).

The environment's tokens come from the chat template: the conversation is rendered with the
new messages, and the text after what the model's input plus its output already spell is
tokenized on its own. Those tokens carry loss mask 0 (the model did not choose them) and
logprob 0; the model's tokens carry mask 1 and the engine's logprobs.

Every turn of every sample of a group runs on the group's worker, so turn ``k + 1`` finds
turn ``k``'s tokens in that worker's radix cache: ``turns[k]["cached_tokens"]`` shows it.
"""

from __future__ import annotations

from radixray.rl.tool_tasks import Environment, ToolTask

TURN_SEED_STRIDE = 1_000_003  # turn t of a sample seeded s samples with s + t * stride


def render(tokenizer, messages: list[dict]) -> str:
    """The conversation in the model's chat template, ready for the assistant's next turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("multi-turn rollouts need a tokenizer with a chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def continuation_ids(tokenizer, rendered: str, output_ids: list[int],
                     history: list[dict]) -> tuple[list[int], str]:
    """The token ids that follow ``output_ids`` when ``history`` (the conversation with the
    model's turn and the environment's messages appended) continues the conversation
    ``rendered`` was, and the new rendering.

    ValueError when the template does not reproduce the model's turn verbatim (a template
    that strips or rewrites assistant messages cannot be continued token in, token out).
    """
    full = render(tokenizer, history)
    spelled = rendered + tokenizer.decode(output_ids, skip_special_tokens=False)
    if full.startswith(spelled):
        return tokenizer.encode(full[len(spelled):], add_special_tokens=False), full
    raise ValueError(
        "the chat template does not render the assistant's turn as the model wrote it, so "
        "the next turn cannot extend its tokens: expected the rendering to continue "
        f"{spelled[-80:]!r}, got {full[len(rendered):len(rendered) + 80]!r}")


def _content(tokenizer, output_ids: list[int]) -> str:
    """The assistant message's content: the turn's text without its end-of-turn token."""
    special = set(tokenizer.all_special_ids)
    end = len(output_ids)
    while end and output_ids[end - 1] in special:
        end -= 1
    return tokenizer.decode(output_ids[:end], skip_special_tokens=False)


def token_versions(meta: dict, n: int) -> list:
    """The weight version of each of a result's ``n`` output tokens."""
    spans = meta.get("weight_versions")
    if not spans:
        return [meta["weight_version"]] * n
    out: list = []
    for span in spans:
        out += [span["weight_version"]] * (span["end"] - span["start"])
    return out


async def run_episode(generate, tokenizer, env: Environment, params: dict) -> dict:
    """One episode: ``generate(input_ids, params)`` is a coroutine returning the engine's
    result for one request (on the group's worker). Returns the sample's fields:
    prompt_ids, output_ids (every token after the prompt, the environment's included),
    loss_mask, logprobs, token_versions, text (the model's turns joined by newlines),
    turns (one dict per model turn), finish_reason (the last turn's) and, for MoE models
    asked for them, routed_experts / routed_experts_start of the last request."""
    messages = env.reset()
    rendered = render(tokenizer, messages)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list = []
    texts: list[str] = []
    turns: list[dict] = []
    finish = ""
    seed = params.get("seed")
    stop = list(dict.fromkeys([*(params.get("stop") or []), *env.stop]))
    for turn in range(env.max_turns):
        turn_params = {**params, "stop": stop}
        if seed is not None:
            turn_params["seed"] = seed + turn * TURN_SEED_STRIDE
        out = await generate(prompt_ids + response, turn_params)
        meta = out["meta_info"]
        ids = list(out["output_ids"])
        response += ids
        mask += [1] * len(ids)
        logprobs += list(out.get("output_token_logprobs") or [0.0] * len(ids))
        versions += token_versions(meta, len(ids))
        text = tokenizer.decode(ids, skip_special_tokens=True)
        texts.append(text)
        finish = (meta.get("finish_reason") or {}).get("type", "")
        turns.append({"cached_tokens": meta["cached_tokens"], "input_tokens": meta["prompt_tokens"],
                      "output_tokens": len(ids), "weight_version": meta["weight_version"],
                      "worker_id": meta.get("worker_id")})
        if finish not in ("stop", "length") or turn == env.max_turns - 1:
            break  # aborted, or the turn limit: the episode ends here
        step = env.step(text)  # a turn cut at max_new_tokens is the environment's to judge
        if step.done:
            break
        messages = [*messages, {"role": "assistant", "content": _content(tokenizer, ids)},
                    *step.messages]
        more, rendered = continuation_ids(tokenizer, rendered, ids, messages)
        response += more
        mask += [0] * len(more)
        logprobs += [0.0] * len(more)
        versions += [versions[-1] if versions else meta["weight_version"]] * len(more)
        turns[-1]["tool_tokens"] = len(more)
    return {"prompt_ids": prompt_ids, "output_ids": response, "loss_mask": mask,
            "logprobs": logprobs, "token_versions": versions, "text": "\n".join(texts),
            "turns": turns, "finish_reason": finish,
            # the last request's routes cover the earlier turns' tokens too when the engine
            # keeps routes by KV slot (enable_return_routed_experts)
            "routed_experts": meta.get("routed_experts"),
            "routed_experts_start": meta.get("routed_experts_start") or 0}


def is_multi_turn(task) -> bool:
    return isinstance(task, ToolTask)
