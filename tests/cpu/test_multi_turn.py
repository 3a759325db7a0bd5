"""Multi-turn tool rollouts: token in / token out, the loss mask, radix reuse across turns,
the calculator task and plugging user code in by import path."""

from __future__ import annotations

import asyncio

import pytest
from rl_helpers import Echo, chatml_copy, length_reward

from radixray.rl.multi_turn import continuation_ids, render, run_episode
from radixray.rl.registry import get_task
from radixray.rl.tasks import Problem, Task
from radixray.rl.tool_tasks import Calculator, Step, calculate


@pytest.fixture(scope="module")
def chatml_llama_dir(tiny_llama_dir, tmp_path_factory):
    return chatml_copy(tiny_llama_dir, str(tmp_path_factory.mktemp("chatml-llama") / "model"))


def test_calculator_evaluates_arithmetic_only():
    assert calculate("47 * 28") == "1316"
    assert calculate(" (3 + 4) * -2 ") == "-14"
    assert calculate("7 / 2") == "3.5" and calculate("8 / 2") == "4"
    assert calculate("1 / 0") == "error: division by zero"
    assert calculate("__import__('os')").startswith("error:")
    assert calculate("9 ** 9").startswith("error:")  # no powers
    assert calculate("10 ** 20").startswith("error:")
    assert calculate("12 +").startswith("error:")


def test_calculator_episode_and_reward():
    task = get_task("calculator")
    [problem] = task.problems(1, seed=4)
    a, b = (int(x) for x in problem.prompt.removeprefix("What is ").rstrip("?").split(" * "))
    env = task.environment(problem)
    opening = env.reset()
    assert opening[0]["role"] == "system" and opening[-1]["content"] == problem.prompt
    step = env.step(f"<calc>{a} * {b}</calc>")
    assert step == Step([{"role": "tool", "content": str(a * b)}])
    assert env.step(str(a * b)).done and env.step("<calc>1+1</calc> so 2").done
    assert task.reward(f"<calc>{a} * {b}</calc>\n{a * b}", problem) == 1.0
    assert task.reward(f"<calc>{a} * {b}</calc>\n{a * b + 1}", problem) == Calculator.FORMAT_REWARD
    assert task.reward("I do not know", problem) == 0.0
    assert not set(task.problems(64, seed=1)) & set(__import__("radixray.rl.tasks", fromlist=["x"])
                                                    .held_out(task, 32, seed=0))


def test_a_task_by_import_path_and_unknown_names():
    assert isinstance(get_task("rl_helpers:Echo"), Echo)
    with pytest.raises(ValueError, match="known tasks: .*calculator"):
        get_task("calculater")
    with pytest.raises(ValueError, match="has no 'Nope'"):
        get_task("rl_helpers:Nope")
    with pytest.raises(ValueError, match="not a radixray.rl.tasks.Task"):
        get_task("rl_helpers:length_reward")
    assert issubclass(Echo, Task)


def test_the_continuation_extends_the_models_tokens_verbatim():
    """SmolLM2's ChatML: after a turn cut at ``</calc>`` the continuation closes the
    assistant's message, adds the tool's message and opens the next assistant turn."""
    from radixray.engine.weights.loader import resolve_model
    tok = resolve_model("default").tokenizer
    messages = [{"role": "user", "content": "What is 12 * 34?"}]
    rendered = render(tok, messages)
    out = tok.encode("<calc>12 * 34</calc>", add_special_tokens=False)
    history = [*messages, {"role": "assistant", "content": "<calc>12 * 34</calc>"},
               {"role": "tool", "content": "408"}]
    ids, full = continuation_ids(tok, rendered, out, history)
    assert tok.decode(ids) == "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    assert full == render(tok, history)
    with pytest.raises(ValueError, match="cannot extend its tokens"):
        continuation_ids(tok, rendered, tok.encode("something else"), history)


def test_an_episode_is_token_in_token_out_with_masks_and_cache_reuse(chatml_llama_dir):
    """Turn k+1's input is exactly turn k's input + output + the environment's tokens; the
    loss mask is 1 on model tokens only; turns 2 and 3 find the conversation cached."""
    from transformers import AutoTokenizer

    from radixray import Engine
    tok = AutoTokenizer.from_pretrained(chatml_llama_dir)
    inputs, outputs = [], []
    with Engine(model=chatml_llama_dir, dtype="float32", max_total_tokens=4096) as eng:
        async def generate(ids, params):
            inputs.append(list(ids))
            [out] = await asyncio.to_thread(eng.generate, input_ids=[list(ids)],
                                            sampling_params=params)
            outputs.append(out)
            return out
        params = {"temperature": 1.0, "max_new_tokens": 6, "seed": 11, "return_logprob": True}
        episode = asyncio.run(run_episode(generate, tok, Echo().environment(
            Problem("echo", "Say 7.", "7")), params))
    assert len(inputs) == len(episode["turns"]) == 3
    prompt, response, mask = episode["prompt_ids"], episode["output_ids"], episode["loss_mask"]
    assert inputs[0] == prompt and len(mask) == len(response) == len(episode["logprobs"])
    for k in range(2):
        env_tokens = inputs[k + 1][len(inputs[k]) + len(outputs[k]["output_ids"]):]
        assert inputs[k + 1] == inputs[k] + outputs[k]["output_ids"] + env_tokens
        assert "you wrote" in tok.decode(env_tokens) and env_tokens
    assert prompt + response == inputs[2] + outputs[2]["output_ids"]
    model_tokens = [t for out in outputs for t in out["output_ids"]]
    assert [t for t, m in zip(response, mask) if m] == model_tokens
    assert sum(mask) == len(model_tokens) < len(response)
    assert all(lp == 0.0 for lp, m in zip(episode["logprobs"], mask) if not m)
    assert [lp for lp, m in zip(episode["logprobs"], mask) if m] == [
        lp for out in outputs for lp in out["output_token_logprobs"]]
    cached = [t["cached_tokens"] for t in episode["turns"]]
    assert cached[1] >= len(inputs[0]) and cached[2] >= len(inputs[1]), cached


def test_the_loss_counts_only_masked_in_tokens():
    """A sample's loss_mask reaches the trainer's mask: the masked-out tokens' logprobs (0
    from the rollout) change nothing."""
    from radixray.rl.trainer import pad_batch, trained_tokens
    samples = [{"prompt_ids": [1, 2], "output_ids": [3, 4, 5, 6], "loss_mask": [1, 0, 0, 1],
                "logprobs": [-0.5, 0.0, 0.0, -0.25], "advantage": 1.0},
               {"prompt_ids": [1], "output_ids": [7], "logprobs": [-1.0], "advantage": -1.0}]
    batch = pad_batch(samples, "cpu")
    assert batch["mask"].tolist() == [[0, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert batch["old"][0].tolist() == [0, -0.5, 0, 0, -0.25]
    assert trained_tokens(samples) == 3


def test_user_reward_and_rollout_functions_by_import_path():
    from radixray.rl.config import GRPOConfig
    from radixray.rl.rollout import single_turn
    cfg = GRPOConfig.parse({"task": "calculator",
                            "reward_function": "rl_helpers:length_reward",
                            "rollout_function": "radixray.rl.rollout:single_turn"})
    assert cfg.reward_fn(get_task("calculator")) is length_reward
    assert cfg.rollout_fn() is single_turn
    from radixray.cluster.config import ConfigError
    with pytest.raises(ConfigError, match="reward_function: .*cannot import module 'nowhere'"):
        GRPOConfig.parse({"reward_function": "nowhere:fn"})
    with pytest.raises(ConfigError, match="rollout_function: .*not a function"):
        GRPOConfig.parse({"rollout_function": "radixray.rl.multi_turn:TURN_SEED_STRIDE"})
