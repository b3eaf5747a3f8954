"""train.muon_ns_coefficients=polar_express: Polar Express (Amsel, Persson, Musco and Gower 2025;
the speedrun's later records), a Newton-Schulz quintic per step, each found by Remez's exchange.
engine/training/muon.py loads this when the option is on.

    coefficients = polar_express_coefficients(3)   # ((a, b, c), ...), one per step
"""
from __future__ import annotations

import functools

import numpy as np

Coefficients = tuple[float, float, float]
# the smallest singular value (of the update over its Frobenius norm) each step's quintic is
# made for; smaller ones still grow, less exactly
POLAR_EXPRESS_LOWER = 1e-3
NEAR_ONE = (15 / 8, -5 / 4, 3 / 8)  # the quintic with p(1) = 1 and p'(1) = p''(1) = 0


def quintic(coefficients: Coefficients, s: np.ndarray | float) -> np.ndarray | float:
    a, b, c = coefficients
    return a * s + b * s**3 + c * s**5


def closest_quintic(lo: float, hi: float) -> tuple[Coefficients, float]:
    """The odd quintic p(s) = a s + b s^3 + c s^5 closest to 1 in max norm over [lo, hi]
    (0 < lo < hi), and that distance E. The best one's error 1 - p alternates in sign at four
    points (lo, two inner turning points, hi) with the same size E (Chebyshev's equioscillation
    theorem); Remez's exchange finds them: solve for the p and E that alternate at the current
    points, move them to where the new error turns, repeat until they stay put."""
    grid = np.geomspace(lo, hi, 20001)
    points = np.linspace(lo, hi, 4)
    for _ in range(100):
        system = np.stack([points, points**3, points**5, [1.0, -1.0, 1.0, -1.0]], axis=1)
        a, b, c, error = np.linalg.solve(system, np.ones(4))
        miss = 1 - quintic((a, b, c), grid)
        turns = np.flatnonzero(np.diff(miss[:-1]) * np.diff(miss[1:]) < 0) + 1
        squares = np.roots([5 * c, 3 * b, a])  # where p' = 0: a quadratic in s^2
        squares = squares[np.isreal(squares) & (squares.real > 0)].real
        if len(turns) != 2 or len(squares) != 2:
            break
        roots = np.sqrt(squares)  # each turn to its exact place, off the grid
        inner = [roots[np.argmin(abs(roots - grid[i]))] for i in turns]
        moved = np.array([lo, *inner, hi])
        if np.allclose(moved, points, rtol=1e-13, atol=0):
            break
        points = moved
    return (float(a), float(b), float(c)), float(abs(error))


@functools.cache
def polar_express_coefficients(steps: int, lower: float = POLAR_EXPRESS_LOWER
                               ) -> tuple[Coefficients, ...]:
    """train.muon_ns_coefficients=polar_express: Polar Express (Amsel, Persson, Musco and Gower
    2025; the speedrun's later records), a quintic per step instead of one for all. Divided by
    its Frobenius norm, an update's singular values lie in (0, 1]; the schedule is made for
    those in [lower, 1]. Step k's quintic is the one closest to 1 on where they can be then,
    [lo, hi] (closest_quintic), which maps them into [1 - E, 1 + E]: step k + 1's interval.
    Each step takes what is left from the last, so fewer steps get near 1: from [1e-3, 1],
    three end in [0.14, 1.86] and five in [0.89, 1.11], where torch's one quintic, made to
    lift small values fast, ends in [0.47, 1.20] after five."""
    schedule, lo, hi = [], lower, 1.0
    for _ in range(steps):
        if hi - lo > 1e-4:
            coefficients, error = closest_quintic(lo, hi)
        else:  # (after ~6 steps) so near 1 that Remez's system is singular: the quintics' limit,
            coefficients = NEAR_ONE  # flat at 1 to third order: 1 + d -> 1 + 2.5 d^3
            error = max(abs(1 - quintic(NEAR_ONE, s)) for s in (lo, hi))
        schedule.append(coefficients)
        lo, hi = 1 - error, 1 + error
    return tuple(schedule)
