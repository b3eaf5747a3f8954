"""The statistics of a report card: Wilson's 95% interval for an accuracy, the unbiased pass@k
estimator, and a normal interval for a mean of per-problem scores in [0, 1].

    wilson(43, 50)            # (0.738, 0.930)
    pass_at_k(n=10, c=3, k=5) # 1 - C(7, 5) / C(10, 5) = 0.9167
    paired_difference([0, 1, 1], [1, 1, 1])   # after - before on the same problems: (0.33, ...)
"""
from __future__ import annotations

import math

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile


def wilson(correct: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion correct / n: unlike the normal one it stays
    inside [0, 1] and is not empty at 0 or n correct (Wilson 1927)."""
    if n == 0:
        return math.nan, math.nan
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples, drawn without replacement from n of which c
    are correct, is correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, unbiased for n >= k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per problem")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_interval(values: list[float], z: float = Z95) -> tuple[float, float]:
    """A normal 95% interval for the mean of per-problem scores in [0, 1] (pass@k with k < n,
    partial rewards), clipped to [0, 1]."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return 0.0, 1.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = z * sd / math.sqrt(n)
    return max(0.0, mean - half), min(1.0, mean + half)


def interval(values: list[float]) -> tuple[float, float]:
    """Wilson's interval when every score is 0 or 1, else the normal one for the mean."""
    if all(v in (0.0, 1.0) for v in values):
        return wilson(sum(values), len(values))
    return mean_interval(values)


def paired_difference(before: list[float], after: list[float], z: float = Z95
                      ) -> tuple[float, float, float]:
    """(mean, low, high): the mean of after - before over the same problems, with a normal 95%
    interval from the differences' spread (paired: each problem its own control)."""
    if len(before) != len(after) or not before:
        raise ValueError("a paired difference needs the same problems, at least one")
    d = [a - b for a, b in zip(after, before)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1))
    half = z * sd / math.sqrt(len(d))
    return mean, mean - half, mean + half
