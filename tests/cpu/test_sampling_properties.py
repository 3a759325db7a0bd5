"""Property tests over the whole legal range of every sampling field (hypothesis).

For any legal parameters, alone or mixed in one batch, every request gets a token in
the vocabulary or a clear per-request error, and no row changes another row's result.
"""

import math
from dataclasses import asdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixray.engine.executor.sampler import NONFINITE_LOGITS, Sampler
from radixray.engine.sampling import MAX_SEED, SamplingParams

V = 48
FINITE = dict(allow_nan=False, allow_infinity=False)


def sampling_params(vocab: int = V, max_new_tokens=st.integers(0, 4)) -> st.SearchStrategy:
    """Every field over its whole legal range, extremes included (5e-324, 1e308, 2**64-1)."""
    return st.builds(
        SamplingParams,
        max_new_tokens=max_new_tokens,
        temperature=st.one_of(st.just(0.0), st.floats(min_value=0.0, **FINITE)),
        top_p=st.floats(min_value=0.0, max_value=1.0, exclude_min=True, **FINITE),
        top_k=st.one_of(st.just(-1), st.integers(1, 2**70)),
        min_p=st.floats(min_value=0.0, max_value=1.0, **FINITE),
        repetition_penalty=st.floats(min_value=0.0, exclude_min=True, **FINITE),
        presence_penalty=st.floats(-2.0, 2.0, **FINITE),
        frequency_penalty=st.floats(-2.0, 2.0, **FINITE),
        seed=st.one_of(st.none(), st.integers(0, MAX_SEED)),
        ignore_eos=st.booleans(),
        return_logprob=st.booleans(),
        top_logprobs_num=st.integers(0, vocab),
        return_unscaled_logprob=st.booleans(),
    )


@st.composite
def rows(draw):
    """One batch row: its parameters, its output history, its logits, and whether the model
    made them non-finite."""
    params = draw(sampling_params())
    history = draw(st.lists(st.integers(0, V - 1), max_size=6))
    logits_seed = draw(st.integers(0, 2**31))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e30]))
    broken = draw(st.sampled_from([None, None, None, None, "nan", "inf", "-inf-all"]))
    return params, history, logits_seed, scale, broken


def _logits(seed: int, scale: float, broken: str | None) -> torch.Tensor:
    row = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale
    if broken == "nan":
        row[seed % V] = float("nan")
    elif broken == "inf":
        row[seed % V] = float("inf")
    elif broken == "-inf-all":
        row[:] = float("-inf")
    return row


def _sample(batch: list, logits: torch.Tensor):
    params = [p for p, *_ in batch]
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    return Sampler(V).sample(logits, params, gens, [list(h) for _, h, *_ in batch])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(rows(), min_size=1, max_size=6))
def test_every_row_gets_a_token_or_its_own_error(batch):
    for p, *_ in batch:
        p.validate(V)  # the strategy draws legal values only
    logits = torch.stack([_logits(s, sc, b) for _, _, s, sc, b in batch])
    out = _sample(batch, logits)
    errors = out.errors or {}
    for i, (p, _h, _s, _sc, broken) in enumerate(batch):
        if broken is not None:
            assert errors.get(i) == NONFINITE_LOGITS and out.token_ids[i] == -1
            continue
        assert i not in errors and 0 <= out.token_ids[i] < V
        if p.return_logprob or p.top_logprobs_num:
            assert math.isfinite(out.logprobs[i])
            assert len(out.top_logprobs[i]) == p.top_logprobs_num
            assert all(math.isfinite(lp) and 0 <= t < V for t, lp in out.top_logprobs[i])
        # Unaffected by its neighbours: a row whose draw is reproducible (greedy, or its
        # own seed) gets the same token alone.
        if p.is_greedy or p.seed is not None:
            alone = _sample([batch[i]], logits[i:i + 1])
            assert alone.token_ids == [out.token_ids[i]]


@settings(max_examples=200, deadline=None)
@given(sampling_params(), st.sampled_from([1e-3, 1.0, 1e30]), st.integers(0, 2**31))
def test_filters_always_keep_the_most_likely_token(p, scale, seed):
    """top-k, top-p and min-p never empty a row: with top_k 1, or top_p / min_p at their
    extremes, the draw is the argmax."""
    logits = _logits(seed, scale, None).unsqueeze(0)
    p.top_k, p.repetition_penalty, p.frequency_penalty, p.presence_penalty = 1, 1.0, 0.0, 0.0
    best = int(logits.argmax())
    assert _sample([(p, [])], logits).token_ids == [best]
    p.top_k, p.top_p, p.temperature = -1, 5e-324, 1.0  # (a huge one makes every token tie)
    assert _sample([(p, [])], logits).token_ids == [best]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from radixray import Engine
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                check_kv_conservation=True) as e:
        yield e


WITNESS = ("the quick brown fox", {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True})


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(sampling_params(vocab=20, max_new_tokens=st.integers(0, 3)), min_size=1,
                max_size=5))
def test_engine_serves_any_legal_mix_in_one_batch(engine, params):
    """Through the real engine: every request of a mixed batch finishes normally, a greedy
    witness in the same batch gives its solo output, and no KV slot is lost."""
    want = engine.generate(WITNESS[0], WITNESS[1])["output_ids"]
    prompts = [f"prompt {i} with some words" for i in range(len(params))] + [WITNESS[0]]
    outs = engine.generate(prompts, [asdict(p) for p in params] + [WITNESS[1]])
    for out, p in zip(outs, params + [None]):
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] in ("length", "stop"), reason
        assert all(0 <= t < engine.runner.vocab_size for t in out["output_ids"])
        if p is not None:
            assert len(out["output_ids"]) <= p.max_new_tokens
    assert outs[-1]["output_ids"] == want
    kv = engine.check_kv_conservation()
    assert kv["running"] == 0 and kv["waiting"] == 0
