import pytest
import torch

from radixray.engine.executor.sampler import SampleOutput, Sampler
from radixray.engine.sampling import SamplingParams

V = 32


def _logits(batch: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, V, generator=g) * 3).to(dtype)


def _run(logits, params, generators=None, histories=None) -> SampleOutput:
    n = len(params)
    return Sampler(V).sample(
        logits,
        params,
        generators if generators is not None else [None] * n,
        histories if histories is not None else [[] for _ in range(n)],
    )


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


GREEDY = SamplingParams(temperature=0.0)


def test_greedy_equals_argmax():
    logits = _logits(1)
    out = _run(logits, [GREEDY])
    assert out.token_ids == [int(logits[0].argmax())]
    assert out.logprobs is None and out.top_logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_batch(dtype):
    logits = _logits(8, dtype=dtype)
    out = _run(logits, [GREEDY] * 8)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_one_equals_greedy():
    logits = _logits(6, seed=3)
    params = [SamplingParams(temperature=1.3, top_k=1) for _ in range(6)]
    assert _run(logits, params).token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_greedy_rows_are_argmax():
    logits = _logits(4, seed=4)
    params = [GREEDY, SamplingParams(temperature=1.0), GREEDY, SamplingParams(temperature=0.7)]
    out = _run(logits, params)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())
    assert all(0 <= t < V for t in out.token_ids)


def test_seed_reproducible_and_batch_independent():
    logits = _logits(4, seed=5) / 3  # flat enough that draws vary
    p = SamplingParams(temperature=1.0, seed=7)
    draws = [_run(logits[:1], [p], [_gen(7)]).token_ids[0] for _ in range(3)]
    assert len(set(draws)) == 1

    # A different seed gives a different sequence of draws (very likely).
    def seq(seed):
        g = _gen(seed)
        return [_run(logits[:1], [p], [g]).token_ids[0] for _ in range(20)]

    assert seq(7) == seq(7)
    assert seq(7) != seq(8)

    # Same row, same generator seed, but batched with other rows (sampled
    # with the global RNG, and another seeded row).
    torch.manual_seed(123)
    params = [
        SamplingParams(temperature=0.9, top_p=0.8),
        p,
        SamplingParams(temperature=1.0, seed=99, top_k=5),
        GREEDY,
    ]
    batched = _run(logits, params, [None, _gen(7), _gen(99), None])
    assert batched.token_ids[1] == draws[0]
    alone_other = _run(logits[2:3], [params[2]], [_gen(99)])
    assert batched.token_ids[2] == alone_other.token_ids[0]


def test_top_p_small_keeps_only_top_token():
    logits = _logits(3, seed=6) / 4
    params = [SamplingParams(temperature=1.0, top_p=1e-3) for _ in range(3)]
    for s in range(10):
        out = _run(logits, params, [_gen(s), None, _gen(s + 100)])
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_restricts_support():
    logits = _logits(1, seed=7) / 10
    top3 = set(logits[0].topk(3).indices.tolist())
    g = _gen(0)
    seen = {_run(logits, [SamplingParams(top_k=3)], [g]).token_ids[0] for _ in range(200)}
    assert seen <= top3 and len(seen) > 1


def test_min_p_filters():
    logits = torch.full((1, V), -10.0)
    logits[0, 3] = 5.0
    logits[0, 9] = 5.0 - 0.1  # prob ratio ~0.9: survives min_p=0.5
    logits[0, 11] = 5.0 - 2.0  # ratio ~0.135: filtered by min_p=0.5
    g = _gen(1)
    p = SamplingParams(temperature=1.0, min_p=0.5)
    seen = {_run(logits, [p], [g]).token_ids[0] for _ in range(300)}
    assert seen == {3, 9}
    # Without min_p token 11 does appear.
    g = _gen(1)
    seen = {_run(logits, [SamplingParams()], [g]).token_ids[0] for _ in range(300)}
    assert 11 in seen


def test_frequency_penalty_changes_argmax():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    hist = [[5, 5]]
    assert _run(logits, [GREEDY], histories=hist).token_ids == [5]
    p = SamplingParams(temperature=0.0, frequency_penalty=0.3)  # 2 - 0.6 < 1.5
    assert _run(logits, [p], histories=hist).token_ids == [6]
    p = SamplingParams(temperature=0.0, frequency_penalty=0.2)  # 2 - 0.4 > 1.5
    assert _run(logits, [p], histories=hist).token_ids == [5]


def test_presence_penalty_changes_argmax():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    hist = [[5, 5, 5]]
    p = SamplingParams(temperature=0.0, presence_penalty=0.6)  # once, not per count
    assert _run(logits, [p], histories=hist).token_ids == [6]
    p = SamplingParams(temperature=0.0, presence_penalty=0.4)
    assert _run(logits, [p], histories=hist).token_ids == [5]


def test_repetition_penalty_changes_argmax():
    logits = torch.full((1, V), -5.0)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert _run(logits, [p], histories=[[5]]).token_ids == [6]  # 2/1.5 < 1.5
    # Negative logits are multiplied: a seen negative token drops further.
    logits = torch.full((1, V), -5.0)
    logits[0, 5], logits[0, 6] = -1.0, -1.2
    assert _run(logits, [p], histories=[[5]]).token_ids == [6]  # -1.5 < -1.2


def test_penalties_only_on_rows_that_ask():
    logits = torch.zeros(2, V)
    logits[:, 5], logits[:, 6] = 2.0, 1.5
    params = [GREEDY, SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    out = _run(logits, params, histories=[[5], [5]])
    assert out.token_ids == [5, 6]


def test_greedy_logprobs_unscaled():
    logits = _logits(2, seed=8)
    params = [SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=4), GREEDY]
    out = _run(logits, params)
    ref = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0] == pytest.approx(float(ref[out.token_ids[0]]), abs=1e-5)
    assert out.logprobs[1] is None and out.top_logprobs[1] == []
    top = out.top_logprobs[0]
    assert len(top) == 4
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert top[0][0] == out.token_ids[0]
    assert top[0][1] == pytest.approx(out.logprobs[0], abs=1e-6)
    ref_top = ref.topk(4)
    assert [t for t, _ in top] == ref_top.indices.tolist()


def test_temperature_scaled_logprobs_default_and_unscaled_option():
    logits = _logits(1, seed=9)
    scaled = SamplingParams(temperature=0.5, return_logprob=True, top_logprobs_num=3)
    out = _run(logits, [scaled], [_gen(0)])
    tok = out.token_ids[0]
    assert out.logprobs[0] == pytest.approx(
        float(torch.log_softmax(logits[0] / 0.5, -1)[tok]), abs=1e-5
    )
    assert out.top_logprobs[0][0][1] == pytest.approx(
        float(torch.log_softmax(logits[0] / 0.5, -1).max()), abs=1e-5
    )

    unscaled = SamplingParams(temperature=0.5, return_logprob=True, return_unscaled_logprob=True)
    out = _run(logits, [unscaled], [_gen(0)])
    tok = out.token_ids[0]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[tok]), abs=1e-5)
    assert out.top_logprobs == [[]]


def test_logprobs_include_penalties():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0, return_logprob=True)
    out = _run(logits, [p], histories=[[5]])
    pen = logits.clone()
    pen[0, 5] -= 1.0
    assert out.token_ids == [6]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(pen[0], -1)[6]), abs=1e-5)


def test_caller_logits_unchanged():
    logits = _logits(4, seed=10)
    before = logits.clone()
    params = [
        SamplingParams(
            temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, return_logprob=True
        ),
        SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.1, presence_penalty=1.0),
        SamplingParams(temperature=1.0, return_logprob=True, top_logprobs_num=2),
        GREEDY,
    ]
    _run(logits, params, [None, _gen(1), None, None], [[1, 2, 2], [3], [], [4]])
    assert torch.equal(logits, before)


def test_empty_batch():
    assert _run(torch.zeros(0, V), []).token_ids == []
