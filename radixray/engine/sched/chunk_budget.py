"""How many prompt tokens a mixed prefill step takes: as many as keep the step's forward
under the inter-token-latency target (``max_itl_ms``), by a cost model measured online.

With mixed chunks (mixed_batch.py) every running stream rides each prefill step, so the gap
between two of its tokens is that step's time. :class:`ChunkBudget` picks the step's prompt
tokens ``n``: the largest with a predicted step time (the riders' tokens and attention
included) within the target, clamped to ``[MIN_PREFILL_TOKENS, chunked_prefill_size]`` so a
prefill always progresses. A step with no stream running has no gap to bound and takes the
whole ``chunked_prefill_size``.

:class:`ForwardCostModel` predicts a step's wall time from its work (:class:`ForwardWork`:
rows through the linear layers, query-key pairs through attention) as ``a + b * tokens +
c * pairs``, fitted to the measured steps by exponentially weighted least squares (each
sample's weight decays by ``decay`` with every later one, so the fit follows the host's
load) with non-negative coefficients. Until the samples vary enough in size to separate
``a`` from ``b``, it scales their mean time by tokens. A step grows at most ``GROWTH`` times
the largest batch measured lately, so the model is never trusted far outside its data.

Nothing here reads a clock: the caller feeds measured seconds in (the tests feed their own).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixray.engine.executor.forward_batch import ForwardBatch

MIN_PREFILL_TOKENS = 32  # prompt tokens a budgeted step takes even when its riders fill the target
START_PREFILL_TOKENS = 64  # before any step was measured
GROWTH = 1.5  # a step's tokens at most this many times the largest batch of the recent samples
RECENT_SAMPLES = 32  # the samples that bound growth
DECAY = 0.9  # a sample's weight after each later one (~10 recent steps dominate the fit)
_SCALE = (1.0, 1e-3, 1e-6)  # features: 1, thousands of tokens, millions of pairs
_RIDGE = 1e-9  # keeps the normal equations solvable when samples barely differ


def attention_pairs(prefix: int, new: int) -> int:
    """Query-key pairs causal attention computes for ``new`` tokens after ``prefix``."""
    return new * prefix + new * (new + 1) // 2


@dataclass(frozen=True)
class ForwardWork:
    """What one forward computes: ``tokens`` rows (the linear layers' work) and ``pairs``
    query-key pairs (attention's)."""

    tokens: int
    pairs: int

    @classmethod
    def of_batch(cls, batch: ForwardBatch) -> ForwardWork:
        return cls(sum(batch.extend_lens),
                   sum(attention_pairs(p, n) for p, n in zip(batch.prefix_lens, batch.extend_lens)))

    def features(self) -> tuple[float, float, float]:
        return _SCALE[0], self.tokens * _SCALE[1], self.pairs * _SCALE[2]


class ForwardCostModel:
    """Predicted seconds of a prefill step from its :class:`ForwardWork` (see the module
    docstring). ``observe`` after each measured step; ``predict`` is None before any."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self._xx = [[0.0] * 3 for _ in range(3)]  # weighted sums of feature products
        self._xy = [0.0] * 3  # weighted sums of feature * seconds
        self._w = 0.0  # the weights' sum
        self._tokens2 = 0.0  # weighted sum of squared token counts (their spread)
        self.samples = 0
        self.recent_tokens: deque[int] = deque(maxlen=RECENT_SAMPLES)
        self.coef: tuple[float, float, float] | None = None  # (a, b, c) in seconds, scaled units

    def observe(self, work: ForwardWork, seconds: float) -> None:
        """A step of ``work`` took ``seconds`` (wall time, the forward and its sampling)."""
        if work.tokens <= 0 or seconds <= 0:
            return
        x = work.features()
        d = self.decay
        # Errors relative to the step's size (not its measured time, which would favour the
        # faster samples of a host whose load went up): small steps count as much as big ones.
        r = 1.0 / (work.tokens * work.tokens)
        for i in range(3):
            self._xy[i] = d * self._xy[i] + r * x[i] * seconds
            for j in range(3):
                self._xx[i][j] = d * self._xx[i][j] + r * x[i] * x[j]
        self._w = d * self._w + r
        self._tokens2 = d * self._tokens2 + r * float(work.tokens) ** 2
        self.samples += 1
        self.recent_tokens.append(work.tokens)
        self.coef = self._fit() if self._spread_ok() else None

    @property
    def max_recent_tokens(self) -> int:
        return max(self.recent_tokens, default=0)

    def predict(self, work: ForwardWork) -> float | None:
        """Seconds a step of ``work`` is expected to take; None before any sample."""
        if not self.samples:
            return None
        if self.coef is None:  # one size measured: its mean time per token
            mean_tokens = self._xx[0][1] / self._w / _SCALE[1]
            return self._xy[0] / self._w * work.tokens / mean_tokens
        return sum(c * f for c, f in zip(self.coef, work.features()))

    def _spread_ok(self) -> bool:
        """Whether the recent batch sizes differ enough (a coefficient of variation of 5%)
        to tell the fixed cost from the per-token one."""
        if self.samples < 3:
            return False
        mean = self._xx[0][1] / self._w / _SCALE[1]
        var = self._tokens2 / self._w - mean * mean
        return var > (0.05 * mean) ** 2

    def _fit(self) -> tuple[float, float, float] | None:
        """Weighted least squares with every coefficient >= 0: a feature whose coefficient
        comes out negative is dropped and the rest refitted."""
        active = [0, 1, 2]
        while active:
            sol = _solve([[self._xx[i][j] + (_RIDGE * self._w if i == j else 0.0)
                           for j in active] for i in active], [self._xy[i] for i in active])
            if sol is None:
                return None
            worst = min(range(len(active)), key=lambda k: sol[k])
            if sol[worst] >= 0:
                coef = [0.0, 0.0, 0.0]
                for k, i in enumerate(active):
                    coef[i] = sol[k]
                return coef[0], coef[1], coef[2]
            active.pop(worst)
        return None


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting (at most 3 x 3); None if
    singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass(frozen=True)
class StepBudget:
    """One step's decision: ``tokens`` prompt tokens (None: unchunked); ``sized`` whether
    the ITL budget chose them (else the fixed chunk: no riders, or the budget is off);
    ``predicted_s`` the step's predicted time (None before any measurement)."""

    tokens: int | None
    sized: bool = False
    predicted_s: float | None = None


class ChunkBudget:
    """Prompt tokens per prefill step. ``target_ms`` None: every step takes ``chunk_size``
    (the fixed chunk); else steps with riders are sized as the module docstring says."""

    def __init__(self, target_ms: float | None, chunk_size: int | None,
                 cost: ForwardCostModel | None = None):
        self.target_s = target_ms / 1000.0 if target_ms and chunk_size else None
        self.chunk_size = chunk_size
        self.cost = cost if cost is not None else ForwardCostModel()
        self.last = StepBudget(chunk_size)

    @property
    def timed(self) -> bool:
        """Whether steps with riders are sized by the target (else by ``chunk_size``)."""
        return self.target_s is not None

    def step_tokens(self, riders: int, rider_pairs: int, context: int = 0) -> StepBudget:
        """This step's prompt tokens, with ``riders`` streams riding (``rider_pairs``: their
        attention's query-key pairs) and the prompt tokens starting after ``context`` tokens
        already in the KV (a chunked prompt's progress; 0 for a new prompt)."""
        if not self.timed or not riders:
            self.last = StepBudget(self.chunk_size)
            return self.last
        chunk = self.chunk_size
        lo = min(MIN_PREFILL_TOKENS, chunk)
        if self.cost.samples:
            hi = int(GROWTH * self.cost.max_recent_tokens) - riders
        else:
            hi = START_PREFILL_TOKENS
        hi = max(lo, min(chunk, hi))

        def predicted(n: int) -> float | None:
            return self.cost.predict(ForwardWork(riders + n, rider_pairs
                                                 + attention_pairs(context, n)))

        if predicted(hi) is None or predicted(hi) <= self.target_s:
            n = hi
        elif predicted(lo) > self.target_s:
            n = lo
        else:  # predicted(lo) fits, predicted(hi) does not; the time grows with n
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if predicted(mid) <= self.target_s else (lo, mid)
            n = lo
        self.last = StepBudget(n, True, predicted(n))
        return self.last

    def observe(self, batch: ForwardBatch, seconds: float) -> None:
        """A prefill step over ``batch`` took ``seconds``: one more sample (only when timed;
        the fixed chunk needs none)."""
        if self.timed:
            self.cost.observe(ForwardWork.of_batch(batch), seconds)
