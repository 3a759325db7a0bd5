"""Overlap scheduling (``enable_overlap_schedule``): the same tokens as the sequential loop.

On a tiny random Llama: greedy equals Hugging Face alone, batched, from the radix cache and
with chunked prefill (``run_all_modes``); a mixed workload (seeded sampling, stop strings,
different lengths, logprobs, penalties that fall back to sequential steps, requests
arriving mid-decode) gives identical outputs with the pipeline on and off, with KV
conservation checked after every step; an abort in the middle of a stream and a request
that reaches the context length end cleanly; the pipeline did run (overlapped steps > 0).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from model_fixtures import random_prompts, run_all_modes

from radixray import Engine

NEW = 24


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.slow  # the on/off identity below covers it in the default run
def test_greedy_equals_hf_in_every_mode_with_overlap(tiny_llama_dir):
    hf = _hf(tiny_llama_dir)
    run_all_modes(tiny_llama_dir, random_prompts(hf.config.vocab_size), hf, "overlap",
                  enable_overlap_schedule=True)


def _workload(vocab: int) -> tuple[list[list[int]], list[dict]]:
    prompts = random_prompts(vocab)
    params = [
        {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True},
        {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": NEW, "ignore_eos": True},
        {"temperature": 1.0, "top_k": 5, "seed": 3, "max_new_tokens": 5, "ignore_eos": True},
        {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
        {"temperature": 0.0, "max_new_tokens": NEW, "return_logprob": True,
         "top_logprobs_num": 2, "ignore_eos": True},
        {"temperature": 0.7, "seed": 11, "max_new_tokens": 17, "ignore_eos": True},
        {"temperature": 0.0, "max_new_tokens": NEW, "repetition_penalty": 1.3,
         "ignore_eos": True},  # penalties: those steps run sequentially
        {"temperature": 0.9, "seed": 5, "max_new_tokens": 9, "ignore_eos": True},
    ]
    return prompts, params


def _run(model_dir: str, overlap: bool, **options) -> tuple[list, dict]:
    with Engine(model=model_dir, dtype="float32", max_total_tokens=8192,
                check_kv_conservation=True, enable_overlap_schedule=overlap, **options) as eng:
        prompts, params = _workload(eng.runner.vocab_size)
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        # one more wave while nothing runs, then one request alone with a stop token
        outs += eng.generate(input_ids=prompts[:4], sampling_params=params[:4])
        first = outs[0]["output_ids"]
        outs.append(eng.generate(input_ids=prompts[0], sampling_params={
            "temperature": 0.0, "max_new_tokens": NEW, "stop_token_ids": [first[5]]}))
        eng.check_kv_conservation()
        stats = eng.call_in_loop(
            lambda s: s.overlap_stats.snapshot() if s.overlap_stats is not None else {})
    flat = []
    for out in outs:
        for o in out if isinstance(out, list) else [out]:
            flat.append((o["output_ids"], o["meta_info"]["finish_reason"],
                         o["meta_info"].get("output_token_logprobs")))
    return flat, stats


def test_identical_outputs_with_overlap_on_and_off(tiny_llama_dir):
    off, _ = _run(tiny_llama_dir, False)
    on, stats = _run(tiny_llama_dir, True)
    assert len(on) == len(off)
    for i, (a, b) in enumerate(zip(on, off)):
        assert a[0] == b[0], f"request {i}: tokens differ with overlap"
        assert a[1] == b[1], f"request {i}: finish reason differs"
        if b[2] is not None:
            assert [t for _, t, _ in a[2]] == [t for _, t, _ in b[2]]
            assert [lp for lp, _, _ in a[2]] == pytest.approx([lp for lp, _, _ in b[2]])
    assert stats["overlapped_steps"] > 0 and stats["drains"] > 0, stats
    assert stats["wasted_rows"] > 0, stats  # finishing requests rode one step more


def test_chunked_prefill_and_the_context_limit_with_overlap(tiny_llama_dir):
    """Requests arriving while others decode (chunked prefill drains the pipeline), and one
    that runs into the context length: the same tokens as sequential."""
    def run(overlap: bool):
        with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                    chunked_prefill_size=16, context_length=64, check_kv_conservation=True,
                    enable_overlap_schedule=overlap) as eng:
            prompts = random_prompts(eng.runner.vocab_size)[:6]
            greedy = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
            outs = eng.generate(input_ids=prompts, sampling_params=greedy)
            eng.check_kv_conservation()
            return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs]
    assert run(True) == run(False)


def test_abort_mid_stream_with_overlap(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                check_kv_conservation=True, enable_overlap_schedule=True) as eng:
        prompt = random_prompts(eng.runner.vocab_size)[2]

        async def collect():
            chunks = []
            async for c in eng.generate_stream(input_ids=prompt, rid="cut", sampling_params={
                    "max_new_tokens": 500, "ignore_eos": True, "temperature": 0.0}):
                chunks.append(c)
                if len(chunks) == 3:
                    eng.abort("cut")
            return chunks

        chunks = asyncio.run(collect())
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        again = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4,
                                                                "temperature": 0.0})
        assert len(again["output_ids"]) == 4
        eng.check_kv_conservation()


def test_overlap_refuses_what_it_cannot_run(tiny_qwen3_moe_dir):
    from radixray.engine.config import EngineConfig
    from radixray.engine.sched.overlap import OverlapDecoder
    config = EngineConfig.from_kwargs(model=tiny_qwen3_moe_dir, enable_overlap_schedule=True,
                                      ep_size=2)
    with pytest.raises(ValueError, match="enable_overlap_schedule cannot run with ep_size"):
        OverlapDecoder.create(config, None)
