"""GRPO advantages and the clipped policy-gradient loss, in plain torch.

The trainer composes four pieces per step:

- ``group_advantages``: GRPO's group-relative baseline (Shao et al. 2024, DeepSeekMath).
  Each prompt is sampled n times; a sample's advantage is its reward measured against its
  siblings', so no value network is needed.
- ``sequence_logprobs``: the trainer's per-token log-probabilities of the sampled tokens,
  to set against the rollout's.
- ``grpo_loss``: PPO's clipped surrogate on the per-token probability ratio to the rollout
  policy, plus an optional k3 KL penalty to a frozen reference, averaged over every
  completion token of the batch (DAPO's token-level mean, Yu et al. 2025).
- ``merge_stats``: the logging stats of several micro-batches as one batch's.

No Ray and no model code: tensors in, a scalar loss and plain floats out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32: bf16/fp16 (and integer or bool) inputs are upcast, fp64 is kept."""
    return torch.promote_types(dtype, torch.float32)


def group_advantages(
    rewards: torch.Tensor, eps: float = 1e-6, scale: bool = True
) -> torch.Tensor:
    """Group-relative advantages: ``rewards`` [G, n] -> advantages [G, n].

    Row g holds the rewards of n samples of one prompt. With ``scale`` each sample gets
    ``(r - mean_g) / (std_g + eps)`` (GRPO's outcome-supervision advantage); without it,
    ``r - mean_g`` only, the Dr. GRPO variant that drops the per-group std so groups with
    nearly equal rewards are not blown up. A group whose rewards are all equal carries no
    signal and gets exact zeros, whatever the rounding of its mean.

    ``std_g`` is the sample (unbiased, divide by n - 1) std, ``torch.std``'s default and
    what the published GRPO implementations (TRL, verl) use, so advantage magnitudes can
    be compared with theirs. It is sqrt(n / (n - 1)) times the population std: for a fixed
    group size that only rescales the step size.

    Integer or half-precision rewards are computed in fp32; fp64 stays fp64.

    Raises ValueError for a non-2D input, a group size below 2 (the advantage of a lone
    sample is its reward minus itself, always 0) or a non-finite reward.
    """
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be 2D [G, n] (G groups of n samples of one prompt), "
            f"got shape {tuple(rewards.shape)}"
        )
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(
            f"group size n must be >= 2, got n={n}: a lone sample's advantage is its "
            f"reward minus its own mean, always 0, so it teaches nothing"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = rewards.to(_compute_dtype(rewards.dtype))
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite; got NaN or inf (check the reward function)")
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    flat = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(adv), adv)


def sequence_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token log-probabilities of ``tokens`` under ``logits``: [B, T, V], [B, T] -> [B, T].

    ``logits`` must already be aligned so ``logits[:, t]`` predicts ``tokens[:, t]`` (for a
    causal LM that is the model output shifted by one). The softmax runs in at least fp32
    over the whole vocabulary, then the chosen token's entry is gathered.

    ``temperature`` divides the logits first. It defaults to 1 because the rollouts ask
    the engine for ``return_unscaled_logprob``, which reports temperature-1 logprobs of the
    full, unfiltered vocabulary whatever temperature sampled the token. What matters for
    the PPO ratio is that old and new logprobs come from the same distribution: if the
    rollout reports scaled logprobs instead, pass its sampling temperature here.

    The result holds a [B, T, V] fp32 intermediate; chunk over B for large vocabularies.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and tokens [B, T]; got logits {tuple(logits.shape)}, "
            f"tokens {tuple(tokens.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    x = logits.to(_compute_dtype(logits.dtype))
    if temperature != 1.0:
        x = x / temperature
    return torch.log_softmax(x, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) from the sampled tokens' logprobs.

    With d = ref - logp, k3 = exp(d) - d - 1 (Schulman, "Approximating KL Divergence",
    2020). Its expectation under pi is the exact KL, and since e^d >= 1 + d it is never
    negative, unlike the plain estimate -d. It is computed as expm1(d) - d, which keeps the
    small differences (k3 ~ d^2 / 2) that exp(d) - 1 would round away; a rounding-level
    negative is clamped to 0. For logprobs in the engine's range [-fp32 max, 0] the result
    is never NaN; it is +inf once ref exceeds logp by more than ~88 nats in fp32.
    """
    d = ref_logprobs - logprobs
    return (torch.expm1(d) - d).clamp(min=0.0)


@dataclass(frozen=True)
class LossStats:
    """Plain floats for logging, each a mean over this call's masked tokens.

    ``loss`` is that call's own token mean of pg + kl_coef * k3, so it equals the returned
    tensor only when ``total_tokens`` is not given. ``clip_frac`` is the share of masked
    tokens where clipping changed the objective (their gradient is 0). ``ratio_max`` is 0
    when there are no masked tokens. Combine micro-batches with ``merge_stats``.
    """

    loss: float
    pg_loss: float
    kl: float
    clip_frac: float
    ratio_mean: float
    ratio_max: float
    tokens: int
    tis_clip_frac: float = 0.0  # share of tokens whose behaviour weight was truncated
    mismatch_kl: float = 0.0  # mean k3 KL(trainer || rollout) over the tokens


def merge_stats(stats: Sequence[LossStats]) -> LossStats:
    """One batch's stats from its micro-batches': token-weighted means, max of the maxima.

    The result equals what ``grpo_loss`` reports on the whole batch at once.
    """
    tokens = sum(s.tokens for s in stats)
    if tokens == 0:
        return LossStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)  # the two TIS stats default to 0

    def mean(field: str) -> float:
        return sum(getattr(s, field) * s.tokens for s in stats) / tokens

    return LossStats(
        loss=mean("loss"),
        pg_loss=mean("pg_loss"),
        kl=mean("kl"),
        clip_frac=mean("clip_frac"),
        ratio_mean=mean("ratio_mean"),
        ratio_max=max(s.ratio_max for s in stats if s.tokens),
        tokens=tokens,
        tis_clip_frac=mean("tis_clip_frac"),
        mismatch_kl=mean("mismatch_kl"),
    )


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    total_tokens: int | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """GRPO's clipped surrogate loss over a batch of sampled completions.

    Inputs, B sequences of T positions:

    - ``logprobs`` [B, T]: the current policy's logprobs of the sampled tokens (carries grad).
    - ``old_logprobs`` [B, T]: the rollout's logprobs, the "old policy" (treated as constant).
    - ``advantages`` [B]: one per sequence, shared by all its tokens (constant).
    - ``mask`` [B, T]: nonzero for completion tokens that count, 0 for prompt and padding.
      Anything under mask 0, even NaN or inf, changes neither the loss nor the gradients.
    - ``ref_logprobs`` [B, T]: a frozen reference policy's logprobs (constant), optional.

    Per masked token, with ratio = exp(logprobs - old_logprobs) and advantage A:

        pg = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)

    PPO's pessimistic bound as used by GRPO (Shao et al. 2024): once the ratio has moved
    past the clip range in the direction the advantage favours, the token gets no more
    gradient; separate ``clip_low``/``clip_high`` allow DAPO's asymmetric "clip-higher".
    With ``ref_logprobs``, ``kl_coef * kl_k3(logprobs, ref_logprobs)`` is added per token
    (k3 is also reported in the stats when ``kl_coef`` is 0).

    The loss is the sum over all masked tokens of the batch divided by their number: a
    token-level mean (DAPO), so a long completion weighs in proportion to its length rather
    than counting as one sequence. For gradient accumulation pass ``total_tokens``, the
    masked-token count of the whole batch, to every micro-batch: each then divides by it
    instead of its own count, and the summed micro-batch gradients equal the whole batch's.
    With no masked tokens at all the loss is a differentiable 0.

    Off-policy samples (asynchronous training, or a rollout engine whose numerics differ
    from the trainer's): pass the logprobs the rollout sampled with as
    ``behaviour_logprobs`` [B, T] and the trainer's own logprobs of the same weights (the
    *proximal* policy, detached) as ``old_logprobs``. This is the decoupled PPO objective
    (Hilton et al. 2022, as AReaL trains) with a truncated importance weight (TIS, as verl
    corrects the rollout/train mismatch): per masked token

        w  = min(exp(old_logprobs - behaviour_logprobs), tis_cap)    (no cap when None)
        pg = -w * min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)

    so the clip keeps the update near the proximal policy, and ``w`` reweights tokens
    sampled by an older (or numerically different) policy, truncated at ``tis_cap`` to
    bound the variance. When the behaviour and proximal logprobs agree, ``w`` is 1 and the
    loss is the on-policy loss exactly. The stats report ``tis_clip_frac`` (tokens whose
    weight was truncated) and ``mismatch_kl``: the mean k3 KL(proximal || behaviour), or
    without ``behaviour_logprobs`` KL(current || old), the rollout/train mismatch at a
    step's first forward.

    Computes in at least fp32. The ratio is not clamped before the exp: with logprobs of
    sampled tokens the log-ratio stays far from fp32's overflow at ~88.

    Returns the scalar loss and ``LossStats`` (see there; means over this call's tokens).
    """
    _check_loss_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs,
                       behaviour_logprobs)
    if tis_cap is not None and not tis_cap >= 1.0:
        raise ValueError(f"tis_cap must be >= 1 (a weight cap below 1 would down-weight even "
                         f"on-policy tokens), got {tis_cap}")
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(
            f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
            f"clip_high={clip_high}"
        )
    if kl_coef < 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the frozen reference's logprobs)")

    keep = mask.bool()
    n_tokens = int(keep.sum())
    if total_tokens is not None and int(total_tokens) < n_tokens:
        raise ValueError(
            f"total_tokens={total_tokens} is fewer than this micro-batch's {n_tokens} masked "
            f"tokens; it must count the masked tokens of the whole batch"
        )
    denom = max(int(total_tokens) if total_tokens is not None else n_tokens, 1)

    dtype = _compute_dtype(logprobs.dtype)
    logp = logprobs.to(dtype)
    # Mask the inputs with where, not by multiplying the outputs: a NaN or inf under mask 0
    # would otherwise come back as a NaN gradient (0 * inf) through exp.
    log_ratio = torch.where(keep, logp - old_logprobs.detach().to(dtype), 0.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(dtype).unsqueeze(1)
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    pg = torch.maximum(unclipped, clipped)
    weight = truncated = mismatch = None
    if behaviour_logprobs is not None:
        log_w = torch.where(keep, old_logprobs.detach().to(dtype)
                            - behaviour_logprobs.detach().to(dtype), 0.0)
        weight = torch.exp(log_w)
        truncated = keep & (weight > tis_cap) if tis_cap is not None else keep & False
        if tis_cap is not None:
            weight = weight.clamp(max=tis_cap)
        mismatch = kl_k3(torch.where(keep, old_logprobs.detach().to(dtype), 0.0),
                         torch.where(keep, behaviour_logprobs.detach().to(dtype), 0.0))
        pg = weight * pg
    else:  # the rollout's logprobs are the old policy: the mismatch is to the current one
        mismatch = kl_k3(torch.where(keep, logp.detach(), 0.0),
                         torch.where(keep, old_logprobs.detach().to(dtype), 0.0))
    per_token = pg
    k3 = None
    if ref_logprobs is not None:
        k3 = kl_k3(
            torch.where(keep, logp, 0.0), torch.where(keep, ref_logprobs.detach().to(dtype), 0.0)
        )
        if kl_coef > 0.0:
            per_token = pg + kl_coef * k3
    loss = torch.where(keep, per_token, 0.0).sum() / denom

    with torch.no_grad():
        zero = torch.zeros((), dtype=dtype, device=logp.device)
        kl_sum = torch.where(keep, k3, 0.0).sum() if k3 is not None else zero
        pg_sum = torch.where(keep, pg, 0.0).sum()
        kept_ratio = torch.where(keep, ratio, 0.0)
        sums = torch.stack([
            pg_sum + kl_coef * kl_sum,
            pg_sum,
            kl_sum,
            (keep & (clipped > unclipped)).sum().to(dtype),
            kept_ratio.sum(),
            torch.cat([kept_ratio.flatten(), zero.unsqueeze(0)]).max(),
            truncated.sum().to(dtype) if truncated is not None else zero,
            torch.where(keep, mismatch, 0.0).sum(),
        ]).tolist()  # one device sync for all the stats
    n = max(n_tokens, 1)
    stats = LossStats(
        loss=sums[0] / n,
        pg_loss=sums[1] / n,
        kl=sums[2] / n,
        clip_frac=sums[3] / n,
        ratio_mean=sums[4] / n,
        ratio_max=sums[5],
        tokens=n_tokens,
        tis_clip_frac=sums[6] / n,
        mismatch_kl=sums[7] / n,
    )
    return loss, stats


def _check_loss_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None = None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    named = {"old_logprobs": old_logprobs, "mask": mask}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    if behaviour_logprobs is not None:
        named["behaviour_logprobs"] = behaviour_logprobs
    for name, t in named.items():
        if t.shape != shape:
            raise ValueError(
                f"{name} must have logprobs' shape {tuple(shape)}, got {tuple(t.shape)}"
            )
    if advantages.shape != shape[:1]:
        raise ValueError(
            f"advantages must be [B] = {tuple(shape[:1])} (one per sequence), "
            f"got {tuple(advantages.shape)}"
        )
