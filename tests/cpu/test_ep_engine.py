"""Expert parallelism in the engine: two engines (one process each, gloo on 127.0.0.1) form
an EP group over a tiny MoE model; each holds half of the expert slots and its own
requests. Every rank's greedy tokens equal Hugging Face's on the full model, whether both
ranks have requests or one has none (it joins every MoE exchange with an empty batch),
and the group stops together.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
from model_fixtures import assert_greedy_equal, hf_greedy, random_prompts

from radixray.engine.config import EngineConfig
from radixray.engine.ep_group import free_tcp_address, join_ep_group

NEW_TOKENS = 12
DEADLINE_S = 240.0
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}

mp.get_context("forkserver").set_forkserver_preload(["torch", "radixray.engine.engine"])


def _rank(rank: int, size: int, address: str, model_dir: str, prompts: list[list[list[int]]],
          results, done) -> None:
    """One rank: an engine in the group; its prompts as one batch; wait for every rank
    before stopping (a rank that stops stops the group)."""
    from radixray import Engine
    eng = Engine(model=model_dir, dtype="float32", max_total_tokens=2048, num_threads=1,
                 ep_size=size, ep_rank=rank, ep_init_method=address, ep_timeout_s=60)
    try:
        mine = prompts[rank]
        outs = eng.generate(input_ids=mine, sampling_params=GREEDY) if mine else []
        results.put((rank, [o["output_ids"] for o in outs], eng.scheduler.ep is not None))
        done.wait(DEADLINE_S)
    finally:
        eng.shutdown()


def _run_group(model_dir: str, prompts: list[list[list[int]]]) -> dict[int, list]:
    ctx = mp.get_context("forkserver")
    results, done = ctx.Queue(), ctx.Event()
    size = len(prompts)
    address = free_tcp_address()
    procs = [ctx.Process(target=_rank, args=(r, size, address, model_dir, prompts, results,
                                             done), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + DEADLINE_S
    try:
        while len(out) < size:
            rank, ids, grouped = results.get(timeout=max(1.0, deadline - time.monotonic()))
            assert grouped, f"rank {rank} left its group"
            out[rank] = ids
        done.set()
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return out


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind, split", [("qwen3_moe", (3, 1)), ("mixtral", (2, 0))])
def test_ep2_greedy_equals_hf_on_every_rank(kind, split, request):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = _hf(model_dir)
    pool = random_prompts(hf.config.vocab_size)
    prompts = [pool[:split[0]], pool[split[0]:split[0] + split[1]]]
    outs = _run_group(model_dir, prompts)
    for rank, mine in enumerate(prompts):
        assert len(outs[rank]) == len(mine)
        for prompt, ours in zip(mine, outs[rank]):
            ref, gaps = hf_greedy(hf, prompt, NEW_TOKENS)
            assert_greedy_equal(ours, ref, gaps, f"{kind} rank {rank} prompt {len(prompt)}")


def test_ep_options_are_checked_by_name(tiny_llama_dir, tiny_qwen3_moe_dir):
    from radixray import Engine
    with pytest.raises(ValueError, match="ep_init_method"):
        join_ep_group(EngineConfig.from_kwargs(model=tiny_qwen3_moe_dir, ep_size=2), 0, None)
    with pytest.raises(ValueError, match="ep_size"):
        EngineConfig.from_kwargs(model=tiny_qwen3_moe_dir, ep_size=0)
    with pytest.raises(ValueError, match="ep_size=2 needs a mixture-of-experts model"):
        Engine(model=tiny_llama_dir, dtype="float32", ep_size=2, ep_rank=0,
               ep_init_method="tcp://127.0.0.1:1")  # refused before joining any group
