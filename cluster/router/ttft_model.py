"""``TtftModel``: what a new request's time to first token will be, learnt from this router's
own requests (the SLO-aware admission of ``admission.py``).

A request admitted here waits behind the prompts admitted before it that have no first token yet:
their prefill is the queue in front of it, wherever the pools hold it (the decode replica's
waiting list, a prefill replica's, a transfer). So its TTFT is fitted as

    ttft = a + b * T + c * R

T the prompt tokens admitted here and still without a first token when the request arrived (its
own included), R those requests (each sample counted, its own included): b is the prefill cost
of a token, c what each request adds (scheduling, hops, its first decode step), a the fixed part.
The fit is least squares over the recent first tokens, each older one weighing ``decay`` as much,
with a weak prior (ridge: a = ``prior_s`` worth ``prior_weight`` observations, b = c = 0 worth a
trace) that keeps it defined before the queue has varied. It is the engine's step-cost model read
off the running system: the ``prefill tokens -> seconds`` line of the planner's profile, measured
here under the load it predicts, the serving hops included.

``predict`` gives a p99 estimate: the fit plus the 99th percentile of its recent residuals
(the last ``RESIDUALS``, each measured against the fit before it, from the ``min_samples``-th
first token on), None until then. Empirical, not a normal p99 (mean + 2.33 RMS): under a burst the
residuals are skewed, a few large, and the normal figure kept the admitted TTFT p99 at 40% of
the SLO while it refused most of what could have met it.
"""

from __future__ import annotations

import collections
import math

# Features are scaled so the normal equations stay well conditioned: T in thousands of tokens, R
# in tens of requests.
_T_SCALE = 1e-3
_R_SCALE = 1e-1
RESIDUALS = 256


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m x = v`` for a 3x3 system by Gaussian elimination with partial pivoting (None when
    singular)."""
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for k in range(col, 4):
                a[r][k] -= f * a[col][k]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][k] * x[k] for k in range(r + 1, 3))) / a[r][r]
    return x


class TtftModel:
    def __init__(
        self,
        decay: float = 0.98,
        min_samples: int = 16,
        prior_s: float = 0.05,
        prior_weight: float = 1.0,
    ) -> None:
        self.decay = decay
        self.min_samples = min_samples
        self.prior = (prior_s, 0.0, 0.0)
        # The fixed part's prior weighs prior_weight observations; the slopes' only a trace,
        # enough to keep the system solvable before the queue has varied (more would shrink
        # them: a 6% low per-token cost with a full observation's weight).
        self._ridge = (prior_weight, 1e-3, 1e-3)
        self.num_samples = 0
        self._zz = [[0.0] * 3 for _ in range(3)]  # decayed sums of z z^T and z y
        self._zy = [0.0] * 3
        self._fit: tuple[float, float, float] = self.prior
        self._residuals: collections.deque[float] = collections.deque(maxlen=RESIDUALS)

    @staticmethod
    def _z(tokens: int, requests: int) -> tuple[float, float, float]:
        return (1.0, tokens * _T_SCALE, requests * _R_SCALE)

    def _mean(self, tokens: int, requests: int) -> float:
        return sum(c * z for c, z in zip(self._fit, self._z(tokens, requests), strict=True))

    def observe(self, tokens: int, requests: int, seconds: float) -> None:
        """A first token: ``seconds`` after a request that arrived with ``tokens`` prompt tokens
        and ``requests`` requests waiting (its own included)."""
        z = self._z(tokens, requests)
        err = seconds - self._mean(tokens, requests)
        d = self.decay
        if self.num_samples >= self.min_samples:  # against a fit, not against the prior
            self._residuals.append(err)
        for i in range(3):
            self._zy[i] = d * self._zy[i] + z[i] * seconds
            for j in range(3):
                self._zz[i][j] = d * self._zz[i][j] + z[i] * z[j]
        self.num_samples += 1
        m = [row[:] for row in self._zz]
        v = self._zy[:]
        for i, weight in enumerate(self._ridge):  # the prior, as that many observations
            m[i][i] += weight
            v[i] += weight * self.prior[i]
        x = _solve3(m, v)
        if x is not None:
            self._fit = (x[0], x[1], x[2])

    @property
    def spread_s(self) -> float:
        """The recent residuals' RMS (seconds; reported in the router's stats)."""
        n = len(self._residuals)
        return math.sqrt(sum(r * r for r in self._residuals) / n) if n else 0.0

    def predict(self, tokens: int, requests: int) -> float | None:
        """The p99 TTFT of a request arriving with ``tokens`` and ``requests`` waiting (its own
        included); None while the model has seen fewer than ``min_samples`` first tokens."""
        if self.num_samples < self.min_samples or not self._residuals:
            return None
        ranked = sorted(self._residuals)
        p99 = ranked[min(len(ranked) - 1, math.ceil(0.99 * len(ranked)) - 1)]
        return max(0.0, self._mean(tokens, requests) + max(0.0, p99))

    def state(self) -> dict[str, float]:
        a, b, c = self._fit
        return {
            "fixed_s": a,
            "per_token_s": b * _T_SCALE,
            "per_request_s": c * _R_SCALE,
            "spread_s": self.spread_s,
            "samples": float(self.num_samples),
        }
