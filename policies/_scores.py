"""The normalisation step of :meth:`policies.pipeline.Pipeline.decide`, compiled with Numba: each term's
feasible raw values min-max normalised (lower-is-better rows negated first), and the weighted sum per site,
the terms added in scorer order. The same floating-point operations as the NumPy code it replaced, in the
same order, so every normalised value and total is the same to the bit (``tests/
test_pipeline_speed_equivalence.py`` checks the pipeline against its reference, explanation records
included). Compiled on first use and cached on disk, as :mod:`policies._shift_search`."""

from __future__ import annotations

import numpy as np

from policies._shift_search import _jit


@_jit()
def normalise(norm: np.ndarray, lower: np.ndarray, flat: np.ndarray, weights: np.ndarray,
              tie_epsilon: float) -> np.ndarray:
    """In place over ``norm`` (float64[terms, feasible sites]: each term's raw values at the feasible sites):
    row ``i`` negated where ``lower[i]``, then ``(row - min) / (max - min)``, or all 0 where the span is not
    above ``tie_epsilon`` (NaN included); rows with ``flat[i]`` are already 0 and left alone. Returns the
    weighted sums per site (float64[feasible sites]): ``row0 × w0 + row1 × w1 + ...`` in row order."""
    terms, k = norm.shape
    for i in range(terms):
        if flat[i]:
            continue
        row = norm[i]
        if lower[i]:
            for j in range(k):
                row[j] = -row[j]
        lo = row[0]
        hi = row[0]
        for j in range(1, k):
            v = row[j]
            if v != v or lo != lo:  # np.minimum / np.maximum propagate NaN
                lo = hi = np.nan
                break
            if v < lo:
                lo = v
            if v > hi:
                hi = v
        span = hi - lo
        if span > tie_epsilon:
            for j in range(k):
                row[j] = (row[j] - lo) / span
        else:
            for j in range(k):
                row[j] = 0.0
    totals = np.empty(k)
    for j in range(k):
        total = norm[0, j] * weights[0]
        for i in range(1, terms):
            total = total + norm[i, j] * weights[i]
        totals[j] = total
    return totals
