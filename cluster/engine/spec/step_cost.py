"""``StepCost``: what a draft row costs, read off the engine's own decode-only steps.

The speculator's threshold (``speculator.py``): a request's j-th draft pays while its chance
beats b B / t_B, b a draft row's cost and t_B a step's without drafts at B requests. And what a
step of so many rows takes (``step_time``), for the speculator to pick the number of drafts that
gives the most tokens a second: the kernels' cost is a staircase in the rows, not a line (the
integer kernels' register tiles take activation rows four at a time: on the default GGUF a step
of 4 rows costs 2.1 one-row steps, and one of 5 rows 2.7).
"""

from __future__ import annotations

import numpy as np


class StepCost:
    """What a draft row costs, measured on the engine's own decode-only steps.

    The runner's time of such a step is fitted as t = a + e B + b D (B decoding requests, D
    draft rows) by least squares over the recent steps (each older one weighs ``decay`` as
    much): b is a draft row's cost and t_B = a + e B the step's cost without drafts, so a
    request's j-th draft pays while p ** j > b B / t_B (``threshold``). Until ``min_steps``
    steps are fitted and D varies apart from B, the prior stands: one more row costs ``prior``
    of a one-row step (the config's ``draft_row_cost``), threshold c B / (1 + c B).
    """

    def __init__(
        self, prior: float, decay: float = 0.98, min_steps: int = 16, min_row_steps: int = 3
    ) -> None:
        self.prior = prior
        self.decay = decay
        self.min_steps = min_steps
        self.min_row_steps = min_row_steps
        self.num_steps = 0
        # by a step's rows (requests + drafts): decayed (weight, sum of seconds)
        self._rows: dict[int, tuple[float, float]] = {}
        self._zz = np.zeros((3, 3))  # decayed sums of z z^T and z t, z = (1, B, D)
        self._zt = np.zeros(3)
        self._fit: tuple[float, float, float] | None = None  # (a, e, b)
        self._stale = False

    def observe(self, requests: int, drafts: int, seconds: float) -> None:
        z = np.array((1.0, float(requests), float(drafts)))
        self._zz = self.decay * self._zz + np.outer(z, z)
        self._zt = self.decay * self._zt + z * seconds
        self.num_steps += 1
        self._stale = True
        w, t = self._rows.get(requests + drafts, (0.0, 0.0))
        self._rows[requests + drafts] = (self.decay * w + 1.0, self.decay * t + seconds)

    def step_time(self, requests: int, drafts: int) -> float:
        """What a decode-only step of ``requests`` requests and ``drafts`` draft rows takes: the
        mean of the recent steps of as many rows, once there are ``min_row_steps`` of them,
        else the fit (seconds); before any fit, the prior in one-row steps, 1 + prior (B + D)
        (only ever compared with itself)."""
        fit = self.fit()
        if fit is None:
            return 1.0 + self.prior * (requests + drafts)
        w, t = self._rows.get(requests + drafts, (0.0, 0.0))
        if w >= self.min_row_steps:
            return t / w
        a, e, b = fit
        return max(a + e * requests + b * drafts, 1e-9)

    def fit(self) -> tuple[float, float, float] | None:
        """(a, e, b), or None while the steps do not tell a draft row's cost apart."""
        if not self._stale:
            return self._fit
        self._stale = False
        self._fit = None
        m = self._zz
        if self.num_steps < self.min_steps:
            return None
        # What is left of D's spread once 1 and B explain what they can: b's information.
        base = m[:2, :2]
        left = m[2, 2] - m[2, :2] @ _pinv_apply(base, m[:2, 2])
        if left < 0.25 * m[0, 0]:
            return None
        a, e, b = (float(v) for v in _pinv_apply(m, self._zt))
        self._fit = (a, e, b)
        return self._fit

    def threshold(self, batch: int) -> float:
        """The per-draft acceptance a request's drafts must beat at ``batch`` requests."""
        fit = self.fit()
        if fit is None:
            c = self.prior * batch
            return c / (1 + c)
        a, e, b = fit
        step = a + e * batch
        if step <= 0.0:
            c = self.prior * batch
            return c / (1 + c)
        return min(0.99, max(0.0, b * batch / step))

    @property
    def row_cost(self) -> float:
        """A draft row's share of a one-request step (the prior until measured)."""
        fit = self.fit()
        if fit is None or fit[0] + fit[1] <= 0.0:
            return self.prior
        a, e, b = fit
        return max(0.0, b / (a + e))


def _pinv_apply(m: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``pinv(m) @ v`` for a small symmetric positive semi-definite ``m``: a direct solve where
    ``m`` is well conditioned (the same solution, at a tenth of an SVD's cost: the fit runs once
    per step), the pseudo-inverse where it is not (e.g. every step the same batch size)."""
    d = np.diag(m)
    if np.all(d > 0.0):
        s = 1.0 / np.sqrt(d)
        if np.linalg.det(m * np.outer(s, s)) > 1e-9:
            return np.linalg.solve(m, v)
    return np.linalg.pinv(m) @ v
