"""Mixed chunked prefill (enable_mixed_chunk): running decode requests ride in prefill forwards,
and every request's output is what it is with the option off (and Hugging Face's, greedy):
alone, batched, from the radix cache, with requests arriving mid-decode, streamed, with
16-token chunks and logprobs, under retraction, and sampled (n > 1) in deterministic mode,
where tokens and logprobs are the same bits; and the engine tests' HF comparison on a MoE
model. KV conservation is checked after every step; the on/off scenarios assert that decode
requests did ride in mixed forwards."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import in_thread, stream, wait_until
from model_fixtures import (
    NEW_TOKENS,
    assert_greedy_equal,
    hf_greedy,
    random_prompts,
    run_all_modes,
)

from radixray import Engine
from radixray.engine.sched.chunk_budget import ForwardCostModel, ForwardWork

GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
LOGPROBS = {**GREEDY, "return_logprob": True, "top_logprobs_num": 3}


def engine(model_dir: str, mixed: bool, **options) -> Engine:
    options = {"dtype": "float32", "max_total_tokens": 8192, **options}
    return Engine(model=model_dir, check_kv_conservation=True, enable_mixed_chunk=mixed, **options)


def arrive_mid_decode(eng: Engine, first: list[list[int]], later: list[list[int]],
                      params: dict, stream_first: bool = False,
                      later_params: list[dict] | None = None) -> list[dict]:
    """``first`` prefill together and decode; after their second token the scheduler pauses
    (on its own thread, so no timing is involved), ``later`` are queued, and it resumes: the
    later prompts prefill while the first ones are mid-decode. With ``stream_first`` the first
    prompt is streamed and its chunks are joined into one result; ``later_params``: one
    sampling dict per later prompt (default ``params``). Results in prompt order."""
    s = eng.scheduler

    def pause_after_two_tokens(sched) -> None:
        if sched.queues.running and all(len(r.output_ids) >= 2 for r in sched.queues.running):
            sched.on_step = None
            sched.pause("in_place")

    eng.pause_generation("in_place")
    threads = []
    if stream_first:
        threads.append(in_thread(stream, engine=eng, input_ids=first[0], sampling_params=params))
        first = first[1:]
    if first:
        threads.append(in_thread(eng.generate, input_ids=first, sampling_params=params))
    wait_until(eng, lambda sched: len(sched.queues.waiting) == len(first) + stream_first)
    s.on_step = pause_after_two_tokens
    eng.continue_generation()
    wait_until(eng, lambda sched: sched.paused is not None)
    threads.append(in_thread(eng.generate, input_ids=later,
                             sampling_params=later_params or params))
    wait_until(eng, lambda sched: len(sched.queues.waiting) == len(later))
    eng.continue_generation()
    results = []
    for t, box in threads:
        t.join(60)
        assert not t.is_alive(), "a request did not finish"
        out = box["out"]
        if isinstance(out, list) and out and "finished" in out[0]:  # a stream's chunks
            out = [{"output_ids": [i for c in out for i in c["output_ids"]],
                    "output_token_logprobs": [x for c in out
                                              for x in c.get("output_token_logprobs", [])]}]
        results.extend(out)
    return results


def run_scenarios(model_dir: str, prompts: list[list[int]], mixed: bool,
                  **options) -> dict[str, list]:
    """Each scenario's results (and the mixed forwards it ran) on one engine setting."""
    got: dict[str, list] = {}
    with engine(model_dir, mixed, **options) as eng:
        got["alone"] = [eng.generate(input_ids=p, sampling_params=GREEDY) for p in prompts[:3]]
        eng.flush_cache()
        got["batch"] = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        got["cached"] = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        eng.flush_cache()
        before = eng.scheduler.stats.mixed_forwards
        got["arrivals"] = arrive_mid_decode(eng, prompts[:4], prompts[4:], GREEDY,
                                            stream_first=True)
        got["mixed arrivals"] = eng.scheduler.stats.mixed_forwards - before
        eng.check_kv_conservation()
    with engine(model_dir, mixed, chunked_prefill_size=16, **options) as eng:
        got["chunked-16 logprobs"] = eng.generate(input_ids=prompts, sampling_params=LOGPROBS)
        got["mixed chunked-16"] = eng.scheduler.stats.mixed_forwards
        eng.check_kv_conservation()
    return got


@pytest.mark.parametrize("backend", ["fused", "torch"])
def test_mixed_equals_unmixed_and_hf(tiny_llama_dir, backend):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    options = {} if backend == "fused" else {"cpu_kernels": False, "attention_backend": "torch"}
    off = run_scenarios(tiny_llama_dir, prompts, False, **options)
    on = run_scenarios(tiny_llama_dir, prompts, True, **options)
    assert off["mixed arrivals"] == off["mixed chunked-16"] == 0
    assert on["mixed arrivals"] > 0 and on["mixed chunked-16"] > 0
    for name in ("alone", "batch", "cached", "arrivals", "chunked-16 logprobs"):
        for i, (a, b) in enumerate(zip(on[name], off[name])):
            ref, gaps = refs[i]
            assert_greedy_equal(a["output_ids"], ref, gaps, f"{backend} {name} mixed, prompt {i}")
            assert a["output_ids"] == b["output_ids"], f"{backend} {name} prompt {i}"
    for p, out in zip(prompts, on["cached"]):
        assert out["meta_info"]["cached_tokens"] == len(p) - 1
    for a, b in zip(on["chunked-16 logprobs"], off["chunked-16 logprobs"]):
        assert a["output_token_logprobs"] == pytest.approx(b["output_token_logprobs"], abs=1e-4)
        assert len(a["output_top_logprobs"]) == len(b["output_top_logprobs"]) == NEW_TOKENS


def test_retraction_with_mixed_chunks(tiny_llama_dir):
    """A pool too small for the admitted batch: requests are retracted and prefill again while
    the others decode (riding in those forwards); each output is its output alone."""
    rng = random.Random(0)
    params = {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": False,
              "stop_token_ids": []}
    with engine(tiny_llama_dir, False) as eng:
        vocab = eng.limits.vocab_size
        candidates = [[rng.randrange(1, vocab) for _ in range(40)] for _ in range(12)]
        # Prompts that run the full 120 tokens (EOS allowed, so admission forecasts less).
        picked = [(p, o["output_ids"]) for p in candidates
                  if len((o := eng.generate(input_ids=p, sampling_params=params))["output_ids"])
                  == params["max_new_tokens"]][:4]
    assert len(picked) == 4, "the tiny model stops early too often for this test"
    prompts, alone = [p for p, _ in picked], [ids for _, ids in picked]
    results = {}
    for mixed in (False, True):
        # 300 slots: admission at conservativeness 0.3 lets three requests in, whose full
        # outputs need more, so decode must retract.
        with engine(tiny_llama_dir, mixed, max_total_tokens=300,
                    schedule_conservativeness=0.3) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            stats = eng.scheduler.stats
            assert stats.num_retracted_reqs > 0
            assert (stats.mixed_forwards > 0) == mixed
            state = eng.check_kv_conservation()
            assert state["running"] == state["waiting"] == 0
        results[mixed] = [o["output_ids"] for o in outs]
        assert sum(o["meta_info"]["num_retractions"] for o in outs) == stats.num_retracted_reqs
    assert results[True] == results[False] == alone


def test_sampled_n_copies_same_bits_in_deterministic_mode(tiny_llama_dir):
    """Deterministic mode: seeded samples of one prompt (n = 3, as the ingress sends them) and
    their logprobs are the same bits with mixing on and off, requests arriving mid-decode."""
    sampled = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": NEW_TOKENS,
               "ignore_eos": True, "return_logprob": True}
    results = {}
    for mixed in (False, True):
        with engine(tiny_llama_dir, mixed, deterministic=True, chunked_prefill_size=16) as eng:
            prompts = random_prompts(eng.limits.vocab_size, seed=5)
            later = [prompts[6]] * 3 + prompts[7:]
            seeds = [{**sampled, "seed": 100 + i} for i in range(len(later))]
            outs = arrive_mid_decode(eng, prompts[:3], later, sampled, later_params=seeds)
            assert (eng.scheduler.stats.mixed_forwards > 0) == mixed
            eng.check_kv_conservation()
        results[mixed] = [(o["output_ids"], o["output_token_logprobs"]) for o in outs]
    assert results[True] == results[False]
    copies = [ids for ids, _ in results[True][3:6]]
    assert len({tuple(c) for c in copies}) > 1, "the n copies (seeds 100-102) should differ"


def test_riders_take_at_most_half_the_chunk():
    from radixray.engine.sched.admission import PrefillBudget

    budget = PrefillBudget(rem_total_tokens=1000, rem_input_tokens=500, rem_chunk_tokens=64)
    budget.reserve_riders(40)
    assert (budget.rem_total_tokens, budget.rem_input_tokens, budget.rem_chunk_tokens) == \
        (960, 460, 32)
    budget = PrefillBudget(rem_total_tokens=1000, rem_input_tokens=500, rem_chunk_tokens=None)
    budget.reserve_riders(8)
    assert (budget.rem_total_tokens, budget.rem_input_tokens, budget.rem_chunk_tokens) == \
        (992, 492, None)
    budget = PrefillBudget(rem_total_tokens=1000, rem_input_tokens=500, rem_chunk_tokens=64)
    budget.reserve_riders(0)  # mixing off: no riders
    assert (budget.rem_total_tokens, budget.rem_chunk_tokens) == (1000, 64)


def test_bench_mixed_chunk_end_to_end(tiny_llama_dir, tmp_path, capsys):
    import json

    from radixray.cli import main
    out = tmp_path / "mixed.json"
    assert main(["bench", "mixed-chunk", "--model", tiny_llama_dir, "--dtype", "float32",
                 "--input-len", "40", "--output-len", "6", "--num-prompts", "6",
                 "--concurrency", "3", "--chunk-sizes", "16", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [(m["chunk_size"], m["mixed"]) for m in r["medians"]] == [(16, False), (16, True)]
    for run in r["runs"]:
        assert run["completed"] == 6 and run["total_output_tokens"] == 6 * 6
        assert run["max_itl_ms"] >= run["p99_itl_ms"] > 0
        assert (run["mixed_forwards"] > 0) == run["mixed"]
    assert "max ITL ms" in capsys.readouterr().out


def test_moe_model_with_mixed_chunks_matches_hf(tiny_qwen3_moe_dir):
    """The engine tests' HF comparison (alone, batched, cached, 16-token chunks, where
    requests ride in mixed forwards) on a MoE model with mixing on."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32).eval()
    run_all_modes(tiny_qwen3_moe_dir, random_prompts(hf.config.vocab_size), hf, "qwen3_moe mixed",
                  enable_mixed_chunk=True)


class LinearCost(ForwardCostModel):
    """A prefill step costs 20 ms + 4 ms per token, whatever the clock says, as if a whole
    2,048-token chunk had been measured (so growth does not hold a step back); the measured
    steps' work is kept."""

    def __init__(self):
        super().__init__()
        self.samples, self.observed = 1, []
        self.recent_tokens.append(2048)

    def observe(self, work: ForwardWork, seconds: float) -> None:
        self.observed.append(work)

    def predict(self, work: ForwardWork) -> float:
        return 0.02 + 0.004 * work.tokens


def record_prefill_steps(sched, mixed: bool, steps: list) -> None:
    """Each prefill step of ``sched`` appends (``mixed``, requests running before it, its
    prompt tokens, its StepBudget, mixed forwards it ran) to ``steps``."""
    builder, stats = sched.prefill, sched.stats
    run = builder.run

    def recorded(items, step):
        running, before = sched.queues.num_running, stats.mixed_forwards
        run(items, step)
        steps.append((mixed, running, sum(n for _, n, _ in items), builder.chunks.last,
                      stats.mixed_forwards - before))

    builder.run = recorded


def test_itl_budget_sizes_steps_and_keeps_outputs(tiny_llama_dir):
    """The budget on (the default), its cost model replaced by a fixed one: long prompts
    arriving mid-decode prefill in steps of exactly the prompt tokens the 302 ms target
    leaves beside the riders (70 tokens a step in all: 20 + 4 x 70 = 300 ms), every running
    request rides every prefill step, each step's work reaches the model, KV is conserved,
    and greedy outputs are the unmixed run's and Hugging Face's."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    rng = random.Random(7)
    vocab = hf.config.vocab_size
    first = random_prompts(vocab)[:4]
    later = [[rng.randrange(1, vocab) for _ in range(n)] for n in (150, 230, 95)]
    outs, steps = {}, []
    for mixed in (False, True):
        with engine(tiny_llama_dir, mixed, max_itl_ms=302) as eng:
            assert eng.scheduler.prefill.chunks.timed == mixed
            cost = LinearCost()
            eng.call_in_loop(lambda sched, c=cost: setattr(sched.prefill.chunks, "cost", c))
            record_prefill_steps(eng.scheduler, mixed, steps)
            outs[mixed] = arrive_mid_decode(eng, first, later, GREEDY)
            eng.check_kv_conservation()
            if mixed:
                assert len(cost.observed) == len([s for s in steps if s[0]])
    sized = [(running, tokens, budget) for mixed, running, tokens, budget, rode in steps
             if mixed and running]
    assert len(sized) >= 6, "the later prompts should take several budgeted steps"
    for mixed, running, tokens, budget, rode in steps:
        if mixed and running:
            assert rode == 1, "every running request rides each prefill step"
            assert budget.sized and budget.tokens == max(32, 70 - running)
            assert tokens <= budget.tokens
        else:
            assert rode == 0 and not budget.sized
    assert any(tokens == budget.tokens < 2048 for _, tokens, budget in sized)
    for i, (a, b, p) in enumerate(zip(outs[True], outs[False], first + later)):
        ref, gaps = hf_greedy(hf, p, NEW_TOKENS)
        assert_greedy_equal(a["output_ids"], ref, gaps, f"budgeted mixed, prompt {i}")
        assert a["output_ids"] == b["output_ids"], f"prompt {i}"
