"""Batched next-token sampling with penalties, filtering and logprobs.

One call handles one decode step of a batch: one logits row per request. The
all-greedy batch without penalties or logprobs is a single argmax. Otherwise
the work is vectorised over rows; only the draw of a row with its own seeded
generator runs per row, so a seeded request gets the same token whether it is
alone or batched with others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixray.engine.sampling import SamplingParams

_F32 = torch.finfo(torch.float32)
# Smallest positive normal and largest finite float32: sampling parameters are clamped into
# [TINY, HUGE] before they divide or scale logits, so no legal value becomes 0 or inf there.
TINY, HUGE = _F32.tiny, _F32.max
DETERMINISTIC_DEFAULT_SEED = 42  # deterministic mode: the seed of a sampled request that gave none
NONFINITE_LOGITS = ("the model produced non-finite logits (NaN or inf) for this request; "
                    "its output so far is kept, no further token was sampled")


@dataclass
class SampleOutput:
    token_ids: list[int]
    # Chosen-token logprob per row; None for rows that did not ask (the whole
    # field is None when no row asked).
    logprobs: list[float | None] | None = None
    # Per row: top-k (token, logprob) sorted by logprob, descending; [] for rows
    # that asked for none (None when no row asked for logprobs at all).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Rows that got no token because their logits were not finite: row -> message. Their
    # token_ids entry is -1. None when every row was sampled.
    errors: dict[int, str] | None = None


def _has_penalty(p: SamplingParams) -> bool:
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0


def _wants_logprob(p: SamplingParams) -> bool:
    return p.return_logprob or p.top_logprobs_num > 0


def _argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's largest value, its index). argmax takes a NaN or +inf over any finite
    value, so the value is finite exactly when the row is usable. Cheaper than ``max(dim)``
    on CPU: one argmax pass plus a gather of B values."""
    tokens = x.argmax(dim=-1)
    return x.gather(1, tokens.unsqueeze(1)).squeeze(1), tokens


def _nonfinite_rows(row_max: torch.Tensor) -> list[int]:
    """Rows whose maximum is not finite: they hold a NaN or +inf, or every entry is -inf.
    The usual all-finite batch costs one sum and one ``.item()`` (a sum that overflows
    only sends it to the exact per-row check)."""
    if math.isfinite(row_max.sum().item()):
        return []
    return (~torch.isfinite(row_max)).nonzero().flatten().tolist()


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise ``log_softmax`` of [N, V] fp32 logits, -inf (a token with no probability
    left) raised to float32's lowest value: JSON has no inf."""
    return torch.log_softmax(logits, dim=-1).clamp_(min=-HUGE)


def unscaled_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """:func:`log_probs` at ``token_ids``: rows [N, V], ids [N] -> [N]. The engine's logprobs
    at temperature 1 (or with ``return_unscaled_logprob``) come from the same call, so a
    trainer that calls this on the same logits gets the same bits."""
    return log_probs(logits).gather(1, token_ids.unsqueeze(1)).squeeze(1)


def _col(params: list[SamplingParams], rows: list[int], name: str, device,
         lo: float = -HUGE) -> torch.Tensor:
    """One float32 column of a sampling field over ``rows``, clamped into [lo, HUGE]."""
    vals = [float(getattr(params[i], name)) for i in rows]
    return torch.tensor(vals, dtype=torch.float32, device=device).clamp_(lo, HUGE).unsqueeze(1)


class Sampler:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        output_histories: list[list[int]],
    ) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(
                f"logits must be [B, V] with B={len(params)}, got {tuple(logits.shape)}"
            )
        batch = len(params)
        if batch == 0:
            return SampleOutput(token_ids=[])

        pen_rows = [i for i, p in enumerate(params) if _has_penalty(p) and output_histories[i]]
        lp_rows = [i for i, p in enumerate(params) if _wants_logprob(p)]
        greedy = [p.is_greedy for p in params]

        # Fast path: one argmax over the batch, no float copy; the B logits it picked say
        # whether a row is finite.
        if all(greedy) and not pen_rows and not lp_rows:
            row_max, tokens = _argmax(logits)
            return self._with_errors(tokens.tolist(), _nonfinite_rows(row_max))

        device = logits.device
        # Out-of-place from here on; .float() may alias an fp32 input.
        x = logits.float()
        row_max, tokens = _argmax(x)
        bad = _nonfinite_rows(row_max)
        if bad:
            # Zero the broken rows so the vectorised work below stays finite; they get no token.
            keep = torch.ones(batch, 1, dtype=torch.bool, device=device)
            keep[bad] = False
            x = torch.where(keep, x, 0.0)
        if pen_rows:
            x = self._apply_penalties(x, params, output_histories, pen_rows)
        if pen_rows or bad:
            row_max, tokens = _argmax(x)

        sample_rows = [i for i in range(batch) if not greedy[i]]
        if sample_rows:
            picked = self._sample_rows(x, row_max, params, generators, sample_rows)
            rows_t = torch.tensor(sample_rows, device=device)
            tokens = tokens.index_put((rows_t,), picked)

        out = self._with_errors(tokens.tolist(), bad)
        if lp_rows:
            out.logprobs, out.top_logprobs = self._logprobs(x, params, lp_rows, tokens, batch)
        return out

    @staticmethod
    def _with_errors(token_ids: list[int], bad: list[int]) -> SampleOutput:
        if not bad:
            return SampleOutput(token_ids=token_ids)
        for i in bad:
            token_ids[i] = -1
        return SampleOutput(token_ids=token_ids, errors={i: NONFINITE_LOGITS for i in bad})

    # ------------------------------------------------------------------ penalties
    @staticmethod
    def _apply_penalties(
        x: torch.Tensor,
        params: list[SamplingParams],
        histories: list[list[int]],
        rows: list[int],
    ) -> torch.Tensor:
        """Frequency, presence and repetition penalties over generated tokens.

        The repetition penalty is clamped into [TINY, HUGE] (0 or inf would make 0 * inf a
        NaN) and the penalised rows into [-HUGE, HUGE], so a row stays finite whatever the
        legal penalty values."""
        device, vocab = x.device, x.shape[1]
        n = len(rows)
        max_len = max(len(histories[i]) for i in rows)
        ids = torch.zeros(n, max_len, dtype=torch.long)
        mask = torch.zeros(n, max_len, dtype=torch.float32)
        for j, i in enumerate(rows):
            h = histories[i]
            ids[j, : len(h)] = torch.tensor(h, dtype=torch.long)
            mask[j, : len(h)] = 1.0
        ids, mask = ids.to(device), mask.to(device)
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        counts.scatter_add_(1, ids.clamp_(0, vocab - 1), mask)
        seen = counts > 0

        rep = _col(params, rows, "repetition_penalty", device, lo=TINY)
        freq = _col(params, rows, "frequency_penalty", device)
        pres = _col(params, rows, "presence_penalty", device)
        rows_t = torch.tensor(rows, device=device)
        sub = x.index_select(0, rows_t)
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = (sub - freq * counts - pres * seen.float()).clamp_(-HUGE, HUGE)
        return x.index_put((rows_t,), sub)

    # ------------------------------------------------------------------ sampling
    def _sample_rows(
        self,
        x: torch.Tensor,
        row_max: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        rows: list[int],
    ) -> torch.Tensor:
        """Return one sampled token id per row in ``rows`` (tensor [len(rows)])."""
        probs = self.filtered_probs(x, row_max, params, rows)
        device = x.device
        out = torch.empty(len(rows), dtype=torch.long, device=device)
        shared = [j for j, i in enumerate(rows) if generators[i] is None]
        if shared:
            sh = torch.tensor(shared, device=device)
            out[sh] = torch.multinomial(probs.index_select(0, sh), 1).squeeze(1)
        for j, i in enumerate(rows):
            g = generators[i]
            if g is not None:
                out[j] = torch.multinomial(probs[j], 1, generator=g)[0]
        return out

    def filtered_probs(self, x: torch.Tensor, row_max: torch.Tensor,
                       params: list[SamplingParams], rows: list[int]) -> torch.Tensor:
        """The sampling distribution of each row in ``rows`` [len(rows), V]: temperature,
        then top-k, top-p and min-p (rows not renormalised after filtering; multinomial and
        speculative verification normalise). ``row_max``: each row's largest logit."""
        device, vocab = x.device, x.shape[1]
        ps = [params[i] for i in rows]
        rows_t = torch.tensor(rows, device=device)
        temps = _col(params, rows, "temperature", device, lo=TINY)
        sub = x.index_select(0, rows_t)
        # Each row is shifted so its best logit is 0 first: dividing by any temperature in
        # [TINY, HUGE] keeps it 0 (the rest <= 0), so the softmax never sees inf and the best
        # token keeps a positive probability. Done for every row, not only when some row
        # would overflow, so a row's probabilities never depend on its batch.
        best = row_max.index_select(0, rows_t).unsqueeze(1)
        probs = torch.softmax((sub - best) / temps, dim=-1)

        use_top_k = any(0 < p.top_k < vocab for p in ps)
        use_top_p = any(p.top_p < 1.0 for p in ps)
        use_min_p = any(p.min_p > 0.0 for p in ps)
        index_map = None
        if use_top_k or use_top_p:  # filter in sorted order
            probs, index_map = probs.sort(dim=-1, descending=True)
            if use_top_k:
                ks = torch.tensor(
                    [p.top_k if 0 < p.top_k < vocab else vocab for p in ps], device=device
                )
                pos = torch.arange(vocab, device=device).unsqueeze(0)
                probs = probs.masked_fill(pos >= ks.unsqueeze(1), 0.0)
            if use_top_p:
                # Over the top-k survivors, renormalised: keep the smallest
                # prefix whose mass reaches top_p; the top token always stays (even a
                # top_p that is 0 in float32).
                top_ps = torch.tensor(
                    [p.top_p if p.top_p < 1.0 else float("inf") for p in ps],
                    dtype=torch.float32,
                    device=device,
                )
                total = probs.sum(dim=-1, keepdim=True)
                mass_before = (probs.cumsum(dim=-1) - probs) / total
                drop = mass_before >= top_ps.unsqueeze(1)
                drop[:, 0] = False
                probs = probs.masked_fill(drop, 0.0)
        if index_map is not None:
            # Back to vocabulary order, so a row's draw does not depend on
            # whether other rows in the batch needed sorting.
            probs = torch.zeros_like(probs).scatter_(1, index_map, probs)
        if use_min_p:
            # min_p <= 1, so the most likely token is never below the threshold.
            min_ps = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device)
            thresh = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
            probs = probs.masked_fill(probs < thresh, 0.0)
        return probs

    # ------------------------------------------------------------------ logprobs
    @staticmethod
    def _logprobs(
        x: torch.Tensor,
        params: list[SamplingParams],
        rows: list[int],
        tokens: torch.Tensor,
        batch: int,
    ) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
        device = x.device
        ps = [params[i] for i in rows]
        scale = [
            1.0 if (p.is_greedy or p.return_unscaled_logprob) else float(p.temperature) for p in ps
        ]
        rows_t = torch.tensor(rows, device=device)
        sub = x.index_select(0, rows_t)
        scaled = [s != 1.0 for s in scale]
        if any(scaled):
            # Shift before scaling (as in sampling) so a tiny temperature cannot overflow;
            # rows at temperature 1 keep their raw logits whatever the other rows need.
            temps = torch.tensor(scale, dtype=torch.float32, device=device).clamp_(TINY, HUGE)
            shifted = (sub - sub.amax(dim=-1, keepdim=True)) / temps.unsqueeze(1)
            sub = torch.where(torch.tensor(scaled, device=device).unsqueeze(1), shifted, sub)
        lp = log_probs(sub)
        chosen = lp.gather(1, tokens.index_select(0, rows_t).unsqueeze(1)).squeeze(1).tolist()

        logprobs: list[float | None] = [None] * batch
        top: list[list[tuple[int, float]]] = [[] for _ in range(batch)]
        for j, i in enumerate(rows):
            logprobs[i] = chosen[j]
        k_max = min(max(p.top_logprobs_num for p in ps), lp.shape[1])
        if k_max > 0:
            vals, idx = lp.topk(k_max, dim=-1, sorted=True)
            vals, idx = vals.tolist(), idx.tolist()
            for j, i in enumerate(rows):
                k = min(ps[j].top_logprobs_num, k_max)
                top[i] = list(zip(idx[j][:k], vals[j][:k], strict=True))
        return logprobs, top
