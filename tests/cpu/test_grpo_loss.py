"""GRPO advantages, k3 KL, the clipped token-level loss and sequence logprobs.

Every expected value comes from hand arithmetic or a plain-Python loop over the same
formula (``statistics``, ``math.exp``), never from the vectorised code under test.
"""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixray.rl.grpo_loss import (
    LossStats,
    group_advantages,
    grpo_loss,
    kl_k3,
    merge_stats,
    sequence_logprobs,
)

F64 = torch.float64
FP32_LOWEST = torch.finfo(torch.float32).min


def _t(rows, dtype=F64, grad=False):
    return torch.tensor(rows, dtype=dtype, requires_grad=grad)


def _reference_loss(logp, old, adv, mask, clip_low, clip_high, ref=None, kl_coef=0.0):
    """Plain-Python GRPO loss: (token-level mean loss, clip fraction, mean k3)."""
    total, clipped, kl, n = 0.0, 0, 0.0, 0
    for b in range(len(logp)):
        a = adv[b]
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(logp[b][t] - old[b][t])
            bounded = min(max(ratio, 1 - clip_low), 1 + clip_high)
            token = -min(ratio * a, bounded * a)
            if bounded * a < ratio * a:
                clipped += 1
            if ref is not None:
                d = ref[b][t] - logp[b][t]
                k3 = math.exp(d) - d - 1
                kl += k3
                token += kl_coef * k3
            total += token
            n += 1
    return total / n, clipped / n, kl / n


def _random_batch(seed, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=F64) * 3
    old = logp + torch.randn(b, t, generator=g, dtype=F64) * 0.4  # some ratios leave [0.8, 1.2]
    ref = logp + torch.randn(b, t, generator=g, dtype=F64) * 0.3
    adv = torch.randn(b, generator=g, dtype=F64)
    lengths = [6, 2, 4, 1][:b]
    mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(t)] for n in lengths], dtype=F64)
    mask[0, 0] = 0.0  # a prompt token at the start
    return logp, old, ref, adv, mask


# ---------------------------------------------------------------- advantages


def test_advantages_known_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    adv = group_advantages(rewards, eps=0.0)
    # Row 0: mean 1/2, sample std sqrt(1/3). Row 1: mean 3/4, sample std 3/2.
    h = math.sqrt(3) / 2
    expected = [[h, -h, -h, h], [-0.5, -0.5, -0.5, 1.5]]
    assert adv.shape == (2, 4) and adv.dtype == torch.float32
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)


def test_advantages_match_statistics_module():
    rows = [[0.3, 1.7, -2.0, 0.5, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0], [-1.0, 0.0, 0.0, 0.0, 9.0]]
    eps = 1e-6
    adv = group_advantages(torch.tensor(rows, dtype=F64), eps=eps)
    for g, row in enumerate(rows):
        m, s = statistics.mean(row), statistics.stdev(row)  # stdev: sample std, n - 1
        for i, r in enumerate(row):
            assert adv[g, i].item() == pytest.approx((r - m) / (s + eps), rel=1e-12)


def test_equal_groups_get_exact_zeros():
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [7.0, 7.0, 7.0]])
    for scale in (True, False):
        adv = group_advantages(rewards, scale=scale)
        assert torch.equal(adv[0], torch.zeros(3)) and torch.equal(adv[2], torch.zeros(3))
        assert adv[1].abs().min() > 0


def test_unscaled_advantages_are_only_centred():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    adv = group_advantages(rewards, scale=False)
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.75, -0.75, -0.75, 2.25]]))


def test_integer_rewards_become_float():
    adv = group_advantages(torch.tensor([[1, 0], [0, 0]]), eps=0.0)
    # Two samples 1, 0: mean 1/2, sample std sqrt(1/2).
    assert adv.dtype == torch.float32
    assert torch.allclose(adv, torch.tensor([[1 / math.sqrt(2), -1 / math.sqrt(2)], [0.0, 0.0]]))


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2), ()])
def test_advantages_reject_non_2d(shape):
    with pytest.raises(ValueError, match=r"2D \[G, n\]"):
        group_advantages(torch.zeros(shape))


def test_advantages_reject_group_of_one():
    with pytest.raises(ValueError, match="group size n must be >= 2"):
        group_advantages(torch.tensor([[1.0], [0.0]]))


def test_advantages_reject_non_finite_rewards():
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))


# ---------------------------------------------------------------- k3


def test_k3_hand_formula_and_zero_at_equality():
    logp = _t([[-1.0, -0.5, -2.0, -0.3]])
    ref = _t([[-1.0, -1.5, -0.2, -0.3000001]])
    k3 = kl_k3(logp, ref)
    for j in range(3):
        d = ref[0, j].item() - logp[0, j].item()
        assert k3[0, j].item() == pytest.approx(math.exp(d) - d - 1, rel=1e-12)
    assert k3[0, 0].item() == 0.0
    # A tiny gap: exp(d) - d - 1 would lose most digits to cancellation; k3 keeps the
    # Taylor value d^2 / 2 + d^3 / 6.
    d = ref[0, 3].item() - logp[0, 3].item()
    assert k3[0, 3].item() == pytest.approx(d * d / 2 + d**3 / 6, rel=1e-6)
    assert (k3 >= 0).all()


@given(
    st.lists(
        st.tuples(
            st.floats(min_value=FP32_LOWEST, max_value=0.0, width=32),
            st.floats(min_value=FP32_LOWEST, max_value=0.0, width=32),
        ),
        min_size=1,
        max_size=16,
    )
)
@settings(max_examples=200, deadline=None)
def test_k3_is_never_negative(pairs):
    # The engine reports logprobs in [-fp32 max, 0] (it clamps -inf); k3 can overflow to +inf
    # for a huge ref - logp, but is never negative or NaN.
    logp = torch.tensor([p for p, _ in pairs], dtype=torch.float32)
    ref = torch.tensor([r for _, r in pairs], dtype=torch.float32)
    k3 = kl_k3(logp, ref)
    assert not k3.isnan().any()
    assert (k3 >= 0).all()


# ---------------------------------------------------------------- loss


def test_ratio_one_gives_minus_mean_advantage():
    logp = _t([[-1.0, -2.0, -0.5, -3.0], [-0.7, -0.1, -0.2, -0.3]], grad=True)
    adv = _t([1.0, -2.0])
    mask = _t([[1, 1, 1, 0], [1, 0, 0, 0]])
    loss, stats = grpo_loss(logp, logp.detach().clone(), adv, mask)
    # Three tokens with A = 1 and one with A = -2: -(3 - 2) / 4.
    assert loss.item() == pytest.approx(-0.25)
    assert stats == LossStats(
        loss=-0.25, pg_loss=-0.25, kl=0.0, clip_frac=0.0, ratio_mean=1.0, ratio_max=1.0, tokens=4
    )
    loss.backward()
    # d(-ratio * A / N)/d logp = -A / N at ratio 1.
    expected = [[-0.25, -0.25, -0.25, 0.0], [0.5, 0.0, 0.0, 0.0]]
    assert torch.allclose(logp.grad, _t(expected))


def test_positive_advantage_above_clip_high_is_clipped():
    old = _t([[-1.0, -1.0, -1.0]])
    logp = (old + _t([[math.log(1.5), math.log(1.1), math.log(0.5)]])).requires_grad_()
    adv, mask = _t([2.0]), _t([[1, 1, 1]])
    loss, stats = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # Tokens: 1.5 clipped to 1.2; 1.1 inside; 0.5 below 1 - clip_low but A > 0 keeps it
    # (the pessimistic min picks the unclipped 0.5 * A).
    assert loss.item() == pytest.approx(-(1.2 * 2 + 1.1 * 2 + 0.5 * 2) / 3)
    assert stats.clip_frac == pytest.approx(1 / 3)
    assert stats.ratio_max == pytest.approx(1.5) and stats.ratio_mean == pytest.approx(3.1 / 3)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-1.1 * 2 / 3)
    assert logp.grad[0, 2].item() == pytest.approx(-0.5 * 2 / 3)


def test_negative_advantage_below_clip_low_is_clipped():
    old = _t([[-1.0, -1.0, -1.0]])
    logp = (old + _t([[math.log(0.5), math.log(0.9), math.log(1.5)]])).requires_grad_()
    adv, mask = _t([-1.0]), _t([[1, 1, 1]])
    loss, stats = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # 0.5 clipped up to 0.8; 0.9 inside; 1.5 above 1 + clip_high but A < 0 keeps it.
    assert loss.item() == pytest.approx((0.8 + 0.9 + 1.5) / 3)
    assert stats.clip_frac == pytest.approx(1 / 3)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(0.9 / 3)
    assert logp.grad[0, 2].item() == pytest.approx(1.5 / 3)


def test_asymmetric_clip_uses_each_bound():
    old = _t([[0.0, 0.0]]) - 1.0
    logp = (old + _t([[math.log(1.25), math.log(1.25)]])).requires_grad_()
    mask = _t([[1, 1]])
    _, tight = grpo_loss(logp, old, _t([1.0]), mask, clip_low=0.2, clip_high=0.2)
    _, higher = grpo_loss(logp, old, _t([1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert tight.clip_frac == 1.0 and higher.clip_frac == 0.0


def test_zero_advantage_is_never_counted_as_clipped():
    old = _t([[-1.0, -1.0]])
    logp = old + _t([[2.0, -2.0]])
    _, stats = grpo_loss(logp, old, _t([0.0]), _t([[1, 1]]))
    assert stats.clip_frac == 0.0


def test_matches_plain_python_reference():
    logp, old, ref, adv, mask = _random_batch(seed=1)
    loss, stats = grpo_loss(logp, old, adv, mask, 0.2, 0.28, ref_logprobs=ref, kl_coef=0.05)
    rows = [r.tolist() for r in (logp, old, ref, mask)]
    want, clip_frac, kl = _reference_loss(
        rows[0], rows[1], adv.tolist(), rows[3], 0.2, 0.28, rows[2], 0.05
    )
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert stats.loss == pytest.approx(want, rel=1e-12)
    assert stats.clip_frac == pytest.approx(clip_frac) and 0 < clip_frac < 1
    assert stats.kl == pytest.approx(kl, rel=1e-12)
    assert stats.tokens == int(mask.sum())


def test_values_under_mask_zero_change_nothing():
    logp, old, ref, adv, mask = _random_batch(seed=2)
    off = mask == 0

    def run(lp, o, r):
        lp = lp.clone().requires_grad_()
        loss, stats = grpo_loss(lp, o, adv, mask, ref_logprobs=r, kl_coef=0.1)
        loss.backward()
        return loss, stats, lp.grad

    base = run(logp, old, ref)
    wild = [float("nan"), float("inf"), -float("inf"), 1e4, -1e30]
    noise = torch.tensor([wild[i % len(wild)] for i in range(int(off.sum()))], dtype=F64)
    lp2, old2, ref2 = logp.clone(), old.clone(), ref.clone()
    lp2[off], old2[off], ref2[off] = noise, noise.flip(0), noise.roll(1)
    loss, stats, grad = run(lp2, old2, ref2)
    assert torch.equal(loss, base[0]) and stats == base[1]
    assert torch.equal(grad, base[2])
    assert (grad[off] == 0).all()


def test_kl_term_is_k3_times_coefficient():
    logp, old, ref, adv, mask = _random_batch(seed=3)
    pg_only, s0 = grpo_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.0)
    with_kl, s1 = grpo_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1)
    with_2kl, s2 = grpo_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.2)
    _, _, kl = _reference_loss(*(x.tolist() for x in (logp, old, adv, mask)), 0.2, 0.2,
                               ref.tolist(), 0.0)
    assert kl > 0 and s0.kl == pytest.approx(kl, rel=1e-12) == s1.kl
    assert (with_kl - pg_only).item() == pytest.approx(0.1 * kl, rel=1e-9)
    assert (with_2kl - pg_only).item() == pytest.approx(0.2 * kl, rel=1e-9)
    assert s1.pg_loss == s0.pg_loss == pytest.approx(pg_only.item())


def test_kl_gradient_pulls_towards_the_reference():
    # A = 0 leaves only the KL: d k3 / d logp = 1 - exp(ref - logp).
    logp = _t([[-1.0, -2.0]], grad=True)
    ref = _t([[-0.5, -2.5]])
    loss, _ = grpo_loss(logp, logp.detach(), _t([0.0]), _t([[1, 1]]), ref_logprobs=ref,
                        kl_coef=0.5)
    loss.backward()
    expected = [0.5 * (1 - math.exp(0.5)) / 2, 0.5 * (1 - math.exp(-0.5)) / 2]
    assert logp.grad[0].tolist() == pytest.approx(expected)
    # Descending the gradient raises logp where the reference is likelier, and lowers it
    # where the reference is less likely.
    assert logp.grad[0, 0] < 0 < logp.grad[0, 1]


def test_loss_is_a_token_mean_not_a_sequence_mean():
    logp = _t([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    adv = _t([1.0, -1.0])
    mask = _t([[1, 1, 1, 1], [1, 0, 0, 0]])  # a long completion and a short one
    loss, _ = grpo_loss(logp, logp, adv, mask)
    token_mean = -(4 * 1.0 + 1 * -1.0) / 5
    sequence_mean = -(1.0 + -1.0) / 2
    assert loss.item() == pytest.approx(token_mean) == -0.6
    assert loss.item() != pytest.approx(sequence_mean)


def test_gradient_accumulation_with_total_tokens_equals_full_batch():
    logp, old, ref, adv, mask = _random_batch(seed=4)
    kw = dict(clip_low=0.2, clip_high=0.28, ref_logprobs=None, kl_coef=0.05)

    def step(parts, total):
        lp = logp.clone().requires_grad_()
        out = []
        for sl in parts:
            loss, stats = grpo_loss(lp[sl], old[sl], adv[sl], mask[sl], **{**kw,
                                    "ref_logprobs": ref[sl]}, total_tokens=total)
            loss.backward()
            out.append((loss.item(), stats))
        return lp.grad, out

    total = int(mask.sum())
    full_grad, [(full_loss, full_stats)] = step([slice(0, 4)], None)
    micro_grad, micro = step([slice(0, 2), slice(2, 4)], total)
    assert torch.allclose(micro_grad, full_grad, rtol=1e-12, atol=1e-15)
    assert sum(loss for loss, _ in micro) == pytest.approx(full_loss, rel=1e-12)
    merged = merge_stats([s for _, s in micro])
    assert merged.tokens == full_stats.tokens == total
    for field in ("loss", "pg_loss", "kl", "clip_frac", "ratio_mean", "ratio_max"):
        assert getattr(merged, field) == pytest.approx(getattr(full_stats, field), rel=1e-12)
    # Without total_tokens each micro-batch divides by its own count (7 vs 4 tokens here),
    # which reweights them: the accumulated gradient is no longer the batch's.
    own_grad, _ = step([slice(0, 2), slice(2, 4)], None)
    assert not torch.allclose(own_grad, full_grad)


def test_minimizing_raises_positive_advantage_logprobs():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    adv = torch.tensor([1.0, -1.0])
    before = sequence_logprobs(logits, tokens)
    loss, _ = grpo_loss(before, before.detach(), adv, mask)
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad  # one SGD step
    after = sequence_logprobs(logits, tokens).detach()
    keep = mask.bool()
    assert (after[0][keep[0]] > before[0][keep[0]]).all()
    assert (after[1][keep[1]] < before[1][keep[1]]).all()
    assert torch.equal(logits.grad[~keep], torch.zeros_like(logits.grad[~keep]))


def test_no_masked_tokens_gives_differentiable_zero():
    logp = _t([[-1.0, -2.0]], grad=True)
    loss, stats = grpo_loss(logp, logp.detach(), _t([1.0]), _t([[0, 0]]))
    loss.backward()
    assert loss.item() == 0.0 and stats.tokens == 0 and stats.ratio_max == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_bf16_inputs_compute_in_fp32():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = grpo_loss(logp, logp.detach(), torch.tensor([1.0]), torch.tensor([[1, 1]]))
    assert loss.dtype == torch.float32
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16


def test_loss_input_errors():
    lp, adv, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"logprobs must be \[B, T\]"):
        grpo_loss(torch.zeros(6), torch.zeros(6), adv, torch.ones(6))
    with pytest.raises(ValueError, match="old_logprobs must have"):
        grpo_loss(lp, torch.zeros(2, 4), adv, mask)
    with pytest.raises(ValueError, match="mask must have"):
        grpo_loss(lp, lp, adv, torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        grpo_loss(lp, lp, torch.zeros(2, 3), mask)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(lp, lp, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="clip_low"):
        grpo_loss(lp, lp, adv, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="total_tokens=5 is fewer"):
        grpo_loss(lp, lp, adv, mask, total_tokens=5)


@given(
    data=st.data(),
    b=st.integers(1, 4),
    t=st.integers(1, 6),
    kl_coef=st.sampled_from([0.0, 0.04, 1.0]),
)
@settings(max_examples=60, deadline=None)
def test_loss_and_gradient_are_finite(data, b, t, kl_coef):
    # Sampled tokens' logprobs: finite, <= 0; a 30-nat gap already means a ratio of 1e13.
    lp = st.floats(min_value=-30.0, max_value=0.0)
    grid = st.lists(st.lists(lp, min_size=t, max_size=t), min_size=b, max_size=b)
    logp = torch.tensor(data.draw(grid), requires_grad=True)
    old, ref = torch.tensor(data.draw(grid)), torch.tensor(data.draw(grid))
    adv = torch.tensor(data.draw(st.lists(st.floats(-10.0, 10.0), min_size=b, max_size=b)))
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t),
                                           min_size=b, max_size=b)))
    loss, stats = grpo_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=kl_coef)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert stats.kl >= 0 and 0 <= stats.clip_frac <= 1
    assert all(math.isfinite(v) for v in (stats.loss, stats.pg_loss, stats.kl, stats.ratio_max))


# ---------------------------------------------------------------- sequence logprobs


def _manual_logprobs(logits, tokens, temperature=1.0):
    out = []
    for b in range(len(logits)):
        row = []
        for t in range(len(logits[b])):
            xs = [x / temperature for x in logits[b][t]]
            m = max(xs)
            lse = m + math.log(sum(math.exp(x - m) for x in xs))
            row.append(xs[tokens[b][t]] - lse)
        out.append(row)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_sequence_logprobs_match_manual_log_softmax(temperature):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 7, generator=g, dtype=F64) * 4
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    got = sequence_logprobs(logits, tokens, temperature=temperature)
    want = _manual_logprobs(logits.tolist(), tokens.tolist(), temperature)
    assert torch.allclose(got, torch.tensor(want, dtype=F64), rtol=0, atol=1e-12)


def test_temperature_divides_logits():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 4, 9, generator=g)
    tokens = torch.randint(0, 9, (1, 4), generator=g)
    assert torch.allclose(sequence_logprobs(logits, tokens, temperature=0.5),
                          sequence_logprobs(logits * 2, tokens))
    assert not torch.allclose(sequence_logprobs(logits, tokens, temperature=0.5),
                              sequence_logprobs(logits, tokens))


def test_sequence_logprobs_half_precision_logits_give_fp32():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(1, 3, 50, generator=g)
    tokens = torch.randint(0, 50, (1, 3), generator=g)
    got = sequence_logprobs(logits.bfloat16(), tokens)
    assert got.dtype == torch.float32
    want = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, tokens.unsqueeze(-1))
    assert torch.equal(got, want.squeeze(-1))


def test_sequence_logprobs_errors():
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        sequence_logprobs(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        sequence_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        sequence_logprobs(torch.zeros(1, 1, 5), torch.zeros(1, 1, dtype=torch.long), 0.0)
