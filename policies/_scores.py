"""The compiled (Numba) steps of :meth:`policies.pipeline.Pipeline.decide`:

- ``gather_normalise``: each term's raw values taken at the feasible sites and min-max normalised
  (lower-is-better rows negated first), the weighted sum per site, the terms added in scorer order, and the
  best site's index (``pick``);
- ``least_scaled``: the carbon and cost scorers' raw values (the least value of a usable model with room,
  scaled, unknown last) in one pass;
- ``window_mean_rows``: the carbon scorer's mean forecast intensity over a run;
- ``free_where``: the free-GPUs scorer's sum over the usable columns.

Each does the same floating-point operations as the NumPy code it replaced, in the same order, so every
raw and normalised value and total is the same to the bit (``tests/test_pipeline_speed_equivalence.py``
checks the pipeline against its reference, explanation records included). Compiled on first use and
cached on disk, as :mod:`policies._shift_search`."""

from __future__ import annotations

import numpy as np

from policies._shift_search import _jit


@_jit()
def gather_normalise(raws: tuple[np.ndarray, ...], feasible: np.ndarray, lower: np.ndarray, weights: np.ndarray,
                     tie_epsilon: float) -> tuple[np.ndarray, np.ndarray, int]:
    """Each term's raw values at the feasible sites, normalised: ``raws`` (a tuple of float64 arrays over all
    sites, one per term; :meth:`policies.pipeline.Pipeline._normalise` hands it read-only contiguous ones, so
    that it compiles once per number of terms) taken at ``feasible`` (int[k]) into row ``i`` of a new
    float64[terms, k] array, negated where ``lower[i]``, then ``(row - min) / (max - min)``, or all 0 where
    the span is not above ``tie_epsilon`` (NaN included). Returns that array, the weighted sums per site
    (``row0 × w0 + row1 × w1 + ...`` in row order) and the index of the best (:func:`pick`)."""
    k = feasible.shape[0]
    terms = len(raws)
    norm = np.empty((terms, k))
    totals = np.zeros(k)
    i = 0
    for raw in literal_unroll(raws):
        # The row taken (negated where lower is better), its least and greatest, and whether it holds NaN
        # (np.minimum / np.maximum would give NaN: the row is then 0).
        row = norm[i]
        negate = lower[i]
        lo = hi = 0.0
        nan = False
        for j in range(k):
            v = np.float64(raw[feasible[j]])
            if negate:
                v = -v
            row[j] = v
            if v != v:
                nan = True
            elif j == 0 or v < lo:
                lo = v
            if j == 0 or v > hi:
                hi = v
        span = hi - lo
        w = weights[i]
        if not nan and span > tie_epsilon:
            for j in range(k):
                v = (row[j] - lo) / span
                row[j] = v
                totals[j] = v * w if i == 0 else totals[j] + v * w
        else:
            for j in range(k):
                row[j] = 0.0
                totals[j] = 0.0 * w if i == 0 else totals[j] + 0.0 * w
        i += 1
    return norm, totals, pick(totals, tie_epsilon)


def literal_unroll(values: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """``numba.literal_unroll`` once the kernels are compiled (:class:`policies._shift_search._Kernel` puts
    it here): a loop over a tuple of arrays (of one type, or of several: one copy of the loop body per type)."""
    return values


@_jit(inline="always")
def pick(totals: np.ndarray, tie_epsilon: float) -> int:
    """The first index whose total is within ``tie_epsilon`` of the highest (``(totals >= max - tie_epsilon)
    .argmax()``: 0 when the highest is NaN)."""
    hi = totals[0]
    for j in range(1, totals.shape[0]):
        v = totals[j]
        if v != v or hi != hi:  # np.maximum propagates NaN
            return 0
        if v > hi:
            hi = v
    bar = hi - tie_epsilon
    for j in range(totals.shape[0]):
        if totals[j] >= bar:
            return j
    return 0


NO_VALUES = np.zeros(0)
"""An empty ``row_factor`` or ``factors`` for :func:`least_scaled`."""


@_jit()
def least_scaled(room: np.ndarray, values: np.ndarray, row_factor: np.ndarray, factors: np.ndarray,
                 divisor: float) -> np.ndarray:
    """The raw values of the carbon and cost scorers in one pass (``policies.scorers._usable.least_where``,
    the scaling, then ``unknown_last``, with their floating-point operations in their order):

    per site ``s``: the least ``values[s, j]`` (float64[n_sites, c]; or [1, c], the same for every site)
    where ``room[s, j]`` (NaN values ignored, as ``np.fmin``; NaN when none), times ``row_factor[s]`` (when
    it has n_sites entries; skipped when empty), times each of ``factors`` in turn, divided by ``divisor``;
    then every NaN replaced by one more than the largest known value (0.0 when none is known)."""
    n, c = room.shape
    # The least value per site, a column at a time (the arrays are column-major): columns in ascending order
    # and strictly less to replace, so each site keeps the first least value, as a pass per site would.
    out = np.full(n, np.nan)
    per_site = values.shape[0] != 1
    for j in range(c):
        if per_site:
            for s in range(n):
                v = values[s, j]
                if room[s, j] and v == v:
                    best = out[s]
                    if best != best or v < best:
                        out[s] = v
        else:
            v = values[0, j]
            if v != v:
                continue
            for s in range(n):
                if room[s, j] and not out[s] <= v:  # none yet (NaN), or more than v
                    out[s] = v
    scaled = row_factor.shape[0] == n and n > 0
    worst = np.nan
    for s in range(n):
        best = out[s]
        if scaled:
            best = best * row_factor[s]
        for f in factors:
            best = best * f
        best = best / divisor
        out[s] = best
        if best == best and (worst != worst or best > worst):
            worst = best
    fill = worst + 1.0 if worst == worst else 0.0
    for s in range(n):
        if out[s] != out[s]:
            out[s] = fill
    return out


@_jit()
def free_where(free: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """int64[n_sites]: per site, the sum of ``free`` (int[n_sites, c]) where ``mask`` (bool[n_sites, c]), a
    column at a time (both are column-major): the free-GPUs scorer's ``(free * mask).sum(axis=1)``."""
    n, c = free.shape
    out = np.zeros(n, dtype=np.int64)
    for j in range(c):
        for s in range(n):
            out[s] += free[s, j] * mask[s, j]
    return out


@_jit()
def window_mean_rows(forecast: np.ndarray, cum: np.ndarray, offset_h: float, duration_h: float) -> np.ndarray:
    """``policies.scorers.carbon.window_mean`` with the rows' running sums: each row's mean over
    ``[offset_h, offset_h + duration_h)`` hours, partial hours pro rata, hours past the end at the last
    value; the same operations in the same order."""
    n, hours = forecast.shape
    span = max(duration_h, 1e-9)
    t0, t1 = offset_h, offset_h + span
    out = np.empty(n)
    for s in range(n):
        if t1 >= hours:
            i1 = cum[s, hours] + (t1 - hours) * forecast[s, hours - 1]
        else:
            h = int(t1)
            i1 = cum[s, h] + (t1 - h) * forecast[s, h]
        if t0 >= hours:
            i0 = cum[s, hours] + (t0 - hours) * forecast[s, hours - 1]
        else:
            h = int(t0)
            i0 = cum[s, h] + (t0 - h) * forecast[s, h]
        out[s] = (i1 - i0) / span
    return out
