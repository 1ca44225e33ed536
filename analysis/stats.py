"""Confidence intervals over trials: Student-t quantiles without SciPy.

The quantile inverts the t CDF, ``F(t) = 1 - I_x(df/2, 1/2) / 2`` with ``x = df/(df + t²)``
for ``t ≥ 0`` (Abramowitz & Stegun 26.7.1), where the regularized incomplete beta
``I_x(a, b)`` is evaluated by Lentz's continued fraction (Numerical Recipes 3rd ed. §6.4)
and the root is found by bisection to ~1e-13 relative. Checked in the tests against the
closed forms for df = 1 (``tan(π(p - 1/2))``) and df = 2, and against the printed table
for df = 3..30.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction for I_x(a, b) (modified Lentz), converges for x < (a+1)/(a+b+2)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            return h
    raise ArithmeticError(f"incomplete beta did not converge for a={a}, b={b}, x={x}")


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for 0 ≤ x ≤ 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom.

    Raises:
        ValueError: ``p`` not in (0, 1) or ``df`` not positive.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p} must be in (0, 1)")
    if not df > 0:
        raise ValueError(f"df={df} must be positive")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


def mean_ci(values, confidence: float = 0.95) -> tuple[float, float, int]:
    """(mean, half-width of the two-sided t confidence interval, n) of the finite values.

    The half-width is ``t_{(1+confidence)/2, n-1} · s / √n`` with ``s`` the sample standard
    deviation (ddof=1); it is NaN for n < 2, and the mean is NaN for n = 0.
    """
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    n = int(v.size)
    if n == 0:
        return math.nan, math.nan, 0
    mean = float(v.mean())
    if n < 2:
        return mean, math.nan, n
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * float(v.std(ddof=1)) / math.sqrt(n)
    return mean, half, n


def t_interval(values) -> tuple[float, float]:
    """(low, high) of the 95 % t interval: a seaborn ``errorbar=`` callable (seaborn ≥ 0.12
    accepts a function mapping a vector to a (min, max) pair)."""
    mean, half, _ = mean_ci(values)
    return mean - half, mean + half
