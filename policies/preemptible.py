"""What the sites report preemptible work past its minimum run time holds, as arrays over sites: GPUs by
priority (``QuotaState.preemptible_gpus_by_priority``, and each tenant's own, ``TenantQuotaState``), and the same
per GPU model where a site reports it (``preemptible_gpus_by_model``; a site agent of an earlier release does not).
A job of higher priority may have a site preempt them, on the model the site gives it (``Snapshot.preemptible_room``,
``QuotaView.own_below``). Units: GPUs; priorities as the sites cap them. Pure: built once per snapshot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from broker import ids
from broker.models import SiteSpec, SiteState

MODEL_INDEX: dict[str, int] = {m: i for i, m in enumerate(ids.GPU_MODEL_IDS)}
N_MODELS = len(ids.GPU_MODEL_IDS)


@dataclass(frozen=True, slots=True)
class OwnPreemptible:
    """One tenant's preemptible GPUs past their minimum run time, by priority, per site, as the sites reported
    them (``TenantQuotaState.preemptible_gpus_by_priority``, and ``preemptible_gpus_by_model`` where a site
    reports it): what a job of its own of higher priority may take back at a site where the tenant is at its
    limit (the site preempts only the tenant's own jobs then, on the model it gives the job)."""

    levels: np.ndarray  # int64[L]: the priorities reported anywhere, ascending
    below: np.ndarray  # float64[n_sites, L + 1]: column k, GPUs held at the k lowest levels, of every model
    ceiling: np.ndarray  # float64[n_sites]: the tenant's priority ceiling at each site (inf: none)
    # float64[n_sites, n_models, L + 1]: the same per model, at the sites that report it per model (``by_site``);
    # None where none does. A site of an earlier release reports only ``below``, counted for every model.
    by_model: np.ndarray | None = None
    by_site: np.ndarray | None = None  # bool[n_sites]: the site reported the GPUs per model

    def held_below(self, priority: int, column: int | None = None, more: np.ndarray | None = None) -> np.ndarray:
        """float64[n_sites]: GPUs of the tenant's preemptible jobs below ``priority`` (capped by each site's
        ceiling for the tenant, as the site caps it), per site: on model ``column`` where the site reports them
        per model, and where ``column`` is None (the site picks the model), on the model that holds most.
        ``more`` (float64[n_sites, n_models]): added per model first, at the sites that report per model."""
        rows = np.arange(self.below.shape[0])
        k = np.searchsorted(self.levels, np.minimum(float(priority), self.ceiling), side="left")
        held = self.below[rows, k]
        if self.by_model is None:
            return held
        on = self.by_model[rows, :, k]  # [n_sites, n_models]
        if more is not None:
            on = on + more
        return np.where(self.by_site, on.max(axis=1) if column is None else on[:, column], held)


def own_preemptible(n: int, reports: list[tuple[int, object]]) -> dict[str, OwnPreemptible]:
    """Per listed tenant that some site reports preemptible GPUs for, by priority: :class:`OwnPreemptible`."""
    held: dict[str, list[tuple[int, dict[int, float], dict[str, dict[int, float]], int | None]]] = {}
    for i, q in reports:
        for t in q.tenants:  # type: ignore[attr-defined]
            if t.listed and t.preemptible_gpus_by_priority:
                held.setdefault(t.tenant, []).append(
                    (i, t.preemptible_gpus_by_priority, t.preemptible_gpus_by_model, t.priority_ceiling))
    out: dict[str, OwnPreemptible] = {}
    for tenant, rows in held.items():
        levels = sorted({p for _, by, models, _ in rows for p in [*by, *(p for on in models.values() for p in on)]})
        ceiling = np.full(n, math.inf)
        for i, _, _, cap in rows:
            if cap is not None:
                ceiling[i] = cap
        below, by_model, by_site = levels_below(n, levels, [(i, by, models) for i, by, models, _ in rows])
        out[tenant] = OwnPreemptible(np.array(levels, dtype=np.int64), below, ceiling, by_model, by_site)
    return out


def levels_below(n: int, levels: list[int], rows: list[tuple[int, dict[int, float], dict[str, dict[int, float]]]]
                 ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """From reports of preemptible GPUs by priority (``rows``: site, GPUs by priority, GPUs per model by
    priority, empty from a site of an earlier release), the GPUs held below each of ``levels`` per site
    (float64[n, L + 1]), the same per model (float64[n, n_models, L + 1], None where no site reports per model)
    and which sites reported per model (bool[n], None likewise)."""
    at = {p: k + 1 for k, p in enumerate(levels)}
    held = np.zeros((n, len(levels) + 1))
    for i, by, _ in rows:
        for p, g in by.items():
            held[i, at[p]] += g
    by_model = by_site = None
    if any(models for _, _, models in rows):
        by_model = np.zeros((n, N_MODELS, len(levels) + 1))
        by_site = np.zeros(n, dtype=bool)
        for i, _, models in rows:
            by_site[i] = bool(models)
            for m, on in models.items():
                for p, g in on.items():
                    by_model[i, MODEL_INDEX[m], at[p]] += g
        np.cumsum(by_model, axis=2, out=by_model)
    return np.cumsum(held, axis=1), by_model, by_site


def preemptible_arrays(specs: list[SiteSpec], states: dict[str, SiteState | None]) -> dict[str, object]:
    """The snapshot's ``preempt_*`` fields from the sites' quota reports (none where no site reports any)."""
    reports = [(i, st.quota.preemptible_gpus_by_priority, st.quota.preemptible_gpus_by_model)
               for i, st in enumerate(states.get(s.name) for s in specs)
               if st is not None and st.quota is not None and st.quota.preemptible_gpus_by_priority]
    if not reports:
        return {}
    levels = sorted({p for _, by, models in reports for p in [*by, *(p for on in models.values() for p in on)]})
    below, by_model, by_site = levels_below(len(specs), levels, reports)
    out: dict[str, object] = {"preempt_levels": tuple(levels), "preempt_below": below}
    if by_model is not None:
        out.update(preempt_by_model=by_model, preempt_by_site=by_site)
    if by_site is None or not by_site.all():  # some site reports by priority only: keep count of GPUs taken
        out["preempt_taken"] = np.zeros(len(specs), dtype=np.int64)
    return out
