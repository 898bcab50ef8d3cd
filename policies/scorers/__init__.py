"""Scorers, one rule per module. A scorer returns a raw value per site (any numeric dtype), in its own
stated units; the
pipeline normalises the raw values to 0..1 over the sites that passed the filters (inverting them when
lower is better), multiplies by the scorer's weight and sums. A weight of 0 turns a scorer off.

A scorer that looks at free capacity may also offer ``raw_fit(fit)``, the same values from the decision's
shared :class:`~policies.filters.gpu_fit.Fit` (where the job fits, worked out once per decision); the
pipeline calls it instead of ``raw``. Values that depend only on the snapshot's fixed facts (telemetry, an
origin's RTTs, a run length's forecast intensity) are cached with ``Snapshot.derived``.

A scorer that ranks a site it knows nothing about (no forecast, no price, no measurement) after every known
one, by a stand-in raw value, says where with ``unknown_fit(fit)`` (bool per site), so that an explanation
(``policies.explain``) gives no raw value there rather than the stand-in, which is no value in the scorer's
units.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from policies.snapshot import JobRequest, Snapshot


class Scorer(Protocol):
    name: str
    higher_is_better: bool

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray: ...
