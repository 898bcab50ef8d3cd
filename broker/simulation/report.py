"""How a simulation run is shown to a person: a table for the terminal and an HTML page with plots.

What it writes
    :func:`format_table` gives one plain-text row per policy, in the order the run holds them, and last
    rows for the offline bound and the whole-job bound, then a line naming the policy with the least
    carbon and what it saves against the worst ``baseline-*`` policy. :func:`write_html` writes
    ``index.html`` into a directory, with the same table, the sites, utilisation per site, the run's
    report lines, the bounds' relaxations and three PNG plots beside it (``intensity.png``,
    ``cumulative_carbon.png``, ``wait_cdf.png``), each with a sentence saying what it shows and how to
    read it. Nothing is computed here that changes a
    figure of the JSON report: the plots are drawn from the per-job arrays of
    :class:`~broker.simulation.results.SimulationResult`, the table from each policy's ``metrics``.

Units
    In the table: carbon in tonnes CO2e with one decimal (kilograms, one decimal, when any value of the
    column is under a tonne); "vs bound" in percent above the offline bound that holds for the policy (the
    bound row's, or for a policy that ended jobs past their deadlines, the same LP on its wider windows:
    ``bound_carbon_kg`` in its metrics), "vs whole-job" above
    the whole-job bound that holds for the policy (no job split); cost in US dollars
    with thousands separators; energy in MWh; wait p95 in seconds, minutes or hours as fits; Jain's
    fairness index on 0..1 with three decimals; utilisation in percent of the federation's GPU-hours.
    A figure the run did not produce is shown as "–". In the plots: intensity in g CO2e per kWh, GPUs
    busy as the hourly mean count of GPUs held (a fractional job counts ``milli / 1000``), cumulative
    carbon in the table's unit (tonnes or kilograms CO2e), waits in seconds on a log axis. The sentences of
    the HTML page give carbon and energy in the table's units too. Times are UTC.

How busy GPUs and cumulative carbon are binned
    :func:`gpus_busy_by_hour` integrates each job's GPUs over the part of each hour it ran, so an hour's
    value is the mean number of GPUs busy in that hour (a job starting half-way through an hour adds half
    its GPUs to it); the run's hours are ``[start + h h, start + (h + 1) h)`` as for the intensity, and a
    job running past the last hour is cut there. Cumulative carbon spreads each job's ``carbon_kg``
    evenly over the hours it ran (a job of zero length counts in the hour it ended), and runs on past the
    last intensity hour until the last job ends, so each curve ends at the policy's total.

Matplotlib is used through :class:`matplotlib.figure.Figure` and the Agg canvas only; pyplot and the
global backend are left alone, so this module is safe to call from a process that draws elsewhere.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from broker.simulation.results import PolicyRun, SimulationResult

__all__ = ["BASELINE_PREFIX", "DASH", "format_table", "gpus_busy_by_hour", "write_html"]

DASH = "–"  # shown for a figure the run did not produce
BASELINE_PREFIX = "baseline-"
HOUR_S = 3600.0
DPI = 110
MAX_CDF_POINTS = 4000  # a wait CDF is drawn through at most this many of its sorted waits
SMOOTH_AFTER_H = 21 * 24  # a longer run's intensity is drawn as a 24-hour moving mean

TABLE_COLUMNS = (
    "policy",
    "carbon",  # header gets the unit chosen for the column
    "vs bound",
    "vs whole-job",
    "cost (USD)",
    "energy (MWh)",
    "wait p95",
    "deadline misses",
    "latency violations",
    "Jain fairness",
    "utilisation",
)


# ----------------------------------------------------------------------------------------------- numbers


def _num(metrics: dict[str, Any] | None, key: str) -> float | None:
    """``metrics[key]`` as a float, or None when missing, None, not a number or NaN."""
    if not metrics:
        return None
    value = metrics.get(key)
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(out) else out


def _human_duration(seconds: float | None) -> str:
    """3.2 h / 41 min / 12 s."""
    if seconds is None:
        return DASH
    if seconds >= HOUR_S:
        return f"{seconds / HOUR_S:,.1f} h"
    if seconds >= 60.0:
        return f"{seconds / 60.0:.0f} min"
    return f"{seconds:.0f} s"


def _count(value: float | None) -> str:
    return DASH if value is None else f"{value:,.0f}"


def _carbon_kg(run: PolicyRun) -> float | None:
    """The policy's carbon: its metric, else the sum over the jobs it ran."""
    value = _num(run.metrics, "carbon_kg")
    if value is not None:
        return value
    if run.carbon_kg.size == 0:
        return None
    total = float(np.nansum(run.carbon_kg[run.ran])) if run.ran.any() else 0.0
    return total


def _gap(run: PolicyRun, key: str, bound_value: float | None, value: float | None) -> float | None:
    """``metrics[key]`` (a fraction above the bound), else computed from the bound when there is one."""
    gap = _num(run.metrics, key)
    if gap is not None:
        return gap
    if bound_value is None or value is None or bound_value <= 0:
        return None
    return value / bound_value - 1.0


def _runs(result: SimulationResult) -> dict[str, PolicyRun]:
    """The rows the table shows above the bounds: the policies, then the whole-job oracle when there is one."""
    runs = dict(result.policies)
    if result.oracle is not None:
        runs[result.oracle.name] = result.oracle
    return runs


def _units(result: SimulationResult) -> tuple[float, str, int]:
    """Kilograms per unit of carbon shown (1000 for tonnes, 1 for kilograms), its name, and the decimals of
    energy in MWh: one choice for the whole run, so the table, the sentences and the plots of one page agree."""
    runs = _runs(result)
    carbons = [_carbon_kg(run) for run in runs.values()]
    known = [c for c in [*carbons, _num(result.offline_bound, "carbon_kg"), _num(result.whole_job_bound, "carbon_kg")]
             if c is not None]
    in_tonnes = bool(known) and min(known) >= 1000.0
    energies = [_num(run.metrics, "energy_kwh") for run in runs.values()]
    energies.append(_num(result.offline_bound, "energy_kwh"))
    known_mwh = [e / 1000.0 for e in energies if e is not None]
    energy_decimals = 1 if known_mwh and min(known_mwh) >= 10.0 else 3
    return (1000.0, "t", energy_decimals) if in_tonnes else (1.0, "kg", energy_decimals)


def _table_cells(result: SimulationResult) -> tuple[list[str], list[list[str]], str]:
    """Header, rows (policies, the whole-job oracle when there is one, then the bound) and the line under the
    table, as strings; the line compares policies only."""
    bound = result.offline_bound
    bound_carbon = _num(bound, "carbon_kg")
    whole_carbon = _num(result.whole_job_bound, "carbon_kg")
    runs = _runs(result)
    carbons = {name: _carbon_kg(run) for name, run in runs.items()}
    scale, unit, energy_decimals = _units(result)

    def carbon_cell(kg: float | None) -> str:
        return DASH if kg is None else f"{kg / scale:,.1f}"

    def energy_cell(kwh: float | None) -> str:
        return DASH if kwh is None else f"{kwh / 1000.0:,.{energy_decimals}f}"

    def cost_cell(usd: float | None) -> str:
        return DASH if usd is None else f"{usd:,.0f}"

    header = list(TABLE_COLUMNS)
    header[1] = f"carbon ({unit} CO2e)"
    rows: list[list[str]] = []
    for name, run in runs.items():
        m = run.metrics
        gap = _gap(run, "gap_to_bound", bound_carbon, carbons[name])
        whole_gap = _gap(run, "gap_to_whole_job_bound", whole_carbon, carbons[name])
        jain = _num(m, "jain_fairness")
        util = _num(m, "utilisation")
        rows.append(
            [
                name,
                carbon_cell(carbons[name]),
                DASH if gap is None else f"{100.0 * gap:+.1f} %",
                DASH if whole_gap is None else f"{100.0 * whole_gap:+.1f} %",
                cost_cell(_num(m, "cost_usd")),
                energy_cell(_num(m, "energy_kwh")),
                _human_duration(_num(m, "wait_p95_s")),
                _count(_num(m, "deadline_misses")),
                _count(_num(m, "latency_violations")),
                DASH if jain is None else f"{jain:.3f}",
                DASH if util is None else f"{100.0 * util:.1f} %",
            ]
        )
    rows.append(
        [
            "offline bound",
            carbon_cell(bound_carbon),
            DASH,
            DASH,
            cost_cell(_num(bound, "cost_usd")),
            energy_cell(_num(bound, "energy_kwh")),
            *([DASH] * 5),
        ]
    )
    if whole_carbon is not None:
        rows.append(["whole-job bound", carbon_cell(whole_carbon), *([DASH] * (len(header) - 2))])
    return header, rows, _verdict({name: carbons[name] for name in result.policies}, scale, unit)


def _verdict(carbons: dict[str, float | None], scale: float, unit: str) -> str:
    """The line under the table: the policy with the least carbon and its saving against the worst baseline."""
    scored = {name: kg for name, kg in carbons.items() if kg is not None}
    if not scored:
        return "No policy reported its carbon."
    best = min(scored, key=lambda name: scored[name])
    best_kg = scored[best]
    line = f"Lowest carbon: {best} ({best_kg / scale:,.1f} {unit} CO2e)"
    baselines = {name: kg for name, kg in scored.items() if name.startswith(BASELINE_PREFIX)}
    if not baselines:
        return line + f"; no {BASELINE_PREFIX}* policy to compare it with."
    worst = max(baselines, key=lambda name: baselines[name])
    worst_kg = baselines[worst]
    if worst == best or worst_kg <= 0:
        return line + f", itself the worst {BASELINE_PREFIX}* policy."
    saved = worst_kg - best_kg
    return (
        line + f", {100.0 * saved / worst_kg:.1f} % ({saved / scale:,.1f} {unit} CO2e) less than the worst "
        f"baseline, {worst} ({worst_kg / scale:,.1f} {unit} CO2e)."
    )


def format_table(result: SimulationResult) -> str:
    """The run's figures as an aligned plain-text table, one row per policy and one for each bound.

    Text is left-aligned, numbers right-aligned; a line under the table names the policy with the least
    carbon and its saving against the worst policy whose name starts with ``baseline-``.
    """
    header, rows, verdict = _table_cells(result)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [cells[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    body = [line(header), rule]
    body += [line(row) for row in rows[:len(result.policies)]]
    body += [rule, *(line(row) for row in rows[len(result.policies):])]
    return "\n".join([*body, "", verdict])


# ------------------------------------------------------------------------------------------ hourly bins


def _hourly_integral(
    slot: np.ndarray, a_s: np.ndarray, b_s: np.ndarray, rate: np.ndarray, n_slots: int, hours: int
) -> np.ndarray:
    """Sum over items of ``rate × (hours of [a, b) inside hour h)`` per slot and hour, float64[n_slots, hours].

    Items must already lie within ``[0, hours h]`` with ``a <= b``. Difference arrays over the hour slots:
    the first and last (partial) hours of each item are added directly, the whole hours between them
    through a running sum, so the cost is O(items + n_slots × hours).
    """
    width = hours + 2
    if slot.size == 0 or hours <= 0:
        return np.zeros((n_slots, max(hours, 0)))
    ha = np.minimum(np.floor(a_s / HOUR_S).astype(np.int64), hours)
    hb = np.minimum(np.floor(b_s / HOUR_S).astype(np.int64), hours)
    base = slot.astype(np.int64) * width
    span = hb > ha
    first_end = np.where(span, (ha + 1) * HOUR_S, b_s)
    direct_idx = [base + ha, base[span] + hb[span]]
    direct_w = [rate * (first_end - a_s) / HOUR_S, rate[span] * (b_s[span] - hb[span] * HOUR_S) / HOUR_S]
    size = n_slots * width
    direct = np.bincount(np.concatenate(direct_idx), weights=np.concatenate(direct_w), minlength=size)
    diff = np.bincount(
        np.concatenate([base[span] + ha[span] + 1, base[span] + hb[span]]),
        weights=np.concatenate([rate[span], -rate[span]]),
        minlength=size,
    )
    full = np.cumsum(diff.reshape(n_slots, width), axis=1)
    return (direct.reshape(n_slots, width) + full)[:, :hours]


def gpus_busy_by_hour(
    site: np.ndarray, start_s: np.ndarray, end_s: np.ndarray, gpus: np.ndarray, n_sites: int, hours: int
) -> np.ndarray:
    """Mean GPUs busy per site and hour, float64[n_sites, hours].

    Hour ``h`` is ``[h × 3600, (h + 1) × 3600)`` seconds after the run's start. Each job with ``site >= 0``
    and finite times adds ``gpus × (seconds of [start_s, end_s) inside the hour) / 3600`` to its site's
    hour, so a job that starts half-way through an hour adds half its GPUs there; what lies before 0 or
    after ``hours`` is cut off. Jobs left out (``site == -1``) add nothing.
    """
    site = np.asarray(site)
    start = np.asarray(start_s, dtype=np.float64)
    end = np.asarray(end_s, dtype=np.float64)
    held = np.asarray(gpus, dtype=np.float64)
    horizon = hours * HOUR_S
    keep = (site >= 0) & (site < n_sites) & np.isfinite(start) & np.isfinite(end)
    a = np.clip(start[keep], 0.0, horizon)
    b = np.clip(end[keep], 0.0, horizon)
    ok = b > a
    return _hourly_integral(site[keep][ok], a[ok], b[ok], held[keep][ok], n_sites, hours)


def _carbon_by_hour(run: PolicyRun) -> np.ndarray:
    """kg CO2e per hour of the run, each job's carbon spread evenly over the hours it ran, float64[hours].

    The hours run on until the last job ends, so the sum is the policy's total over the jobs it ran.
    """
    ran = run.ran & np.isfinite(run.start_s) & np.isfinite(run.end_s) & np.isfinite(run.carbon_kg)
    a = np.maximum(run.start_s[ran], 0.0)
    b = np.maximum(run.end_s[ran], a)
    kg = run.carbon_kg[ran]
    if a.size == 0:
        return np.zeros(0)
    hours = max(1, math.ceil(float(b.max()) / HOUR_S))
    spread = b > a
    rate = kg[spread] / ((b[spread] - a[spread]) / HOUR_S)  # kg per hour of the job's run
    out = _hourly_integral(np.zeros(int(spread.sum()), np.int64), a[spread], b[spread], rate, 1, hours)[0]
    point = ~spread
    if point.any():
        out += np.bincount(
            np.minimum(np.floor(b[point] / HOUR_S).astype(np.int64), hours - 1), weights=kg[point], minlength=hours
        )
    return out


# --------------------------------------------------------------------------------------------- the plots


def _best_policy(result: SimulationResult) -> str | None:
    """The policy with the least carbon (the first one when none reported carbon), or None without policies."""
    scored: dict[str, float] = {}
    for name, run in result.policies.items():
        kg = _carbon_kg(run)
        if kg is not None:
            scored[name] = kg
    if scored:
        return min(scored, key=lambda name: scored[name])
    return next(iter(result.policies), None)


def _hour_axis(start: datetime, n: int, offset_h: float = 0.0) -> np.ndarray:
    """datetime64 of ``start + (offset + h) h`` for h in 0..n-1 (UTC, naive for matplotlib)."""
    base = np.datetime64(start.astimezone(UTC).replace(tzinfo=None), "s")
    return base + (np.arange(n) * 3600 + round(offset_h * 3600)).astype("timedelta64[s]")


def _date_axis(ax: Any) -> None:
    import matplotlib.dates as mdates

    locator = mdates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))


def _policy_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The same colour per policy in every plot; baselines dashed."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {
        name: {"color": cmap(i % 10), "linestyle": "--" if name.startswith(BASELINE_PREFIX) else "-"}
        for i, name in enumerate(names)
    }


def _mean_intensity(series: np.ndarray) -> float:
    return float(np.nanmean(series)) if np.isfinite(series).any() else math.inf


def _moving_mean(series: np.ndarray, width: int) -> np.ndarray:
    """Centred moving mean along axis 1 over ``width`` values, ignoring NaN; NaN where the window is cut."""
    values = np.nan_to_num(series, nan=0.0)
    counts = np.isfinite(series).astype(np.float64)
    zero = np.zeros((series.shape[0], 1))
    csum = np.concatenate([zero, np.cumsum(values, axis=1)], axis=1)
    ccount = np.concatenate([zero, np.cumsum(counts, axis=1)], axis=1)
    n = series.shape[1]
    lo = np.clip(np.arange(n) - width // 2, 0, n)
    hi = np.clip(np.arange(n) + (width - width // 2), 0, n)
    total, count = csum[:, hi] - csum[:, lo], ccount[:, hi] - ccount[:, lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((count > 0) & (hi - lo == width), total / count, np.nan)


def _plot_intensity(result: SimulationResult, best: str | None, path: Path) -> None:
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    sites = result.sites
    n, hours = sites.n_sites, sites.hours
    # Sites from the cleanest zone (mean over the run) to the dirtiest: the legend reads in that order and
    # the stacked load puts the cleanest sites at the bottom. A colour is a site's in both panels.
    order = sorted(range(n), key=lambda i: (_mean_intensity(sites.intensity[i]), sites.names[i]))
    cmap = colormaps["tab20"] if n > 10 else colormaps["tab10"]
    colours = {site: cmap(rank % cmap.N) for rank, site in enumerate(order)}
    panels = 2 if best is not None else 1
    fig = Figure(figsize=(12, 4.2 * panels), layout="constrained")
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]

    # Over more than three weeks hourly lines of many zones merge into a band: draw a 24-hour moving mean.
    smooth = hours > SMOOTH_AFTER_H
    shown = _moving_mean(sites.intensity, 24) if smooth else sites.intensity
    x_top = _hour_axis(result.start, hours, 0.5)

    ax = axes[0]
    drawn: list[int] = []  # sites whose line is drawn; a site with the same series as one drawn joins its label
    labels: dict[int, list[str]] = {}
    for i in order:
        same = next(
            (j for j in drawn if sites.zones[j] == sites.zones[i]
             and np.array_equal(sites.intensity[i], sites.intensity[j], equal_nan=True)),
            None,
        )
        if same is None:
            drawn.append(i)
            labels[i] = [sites.names[i]]
        else:
            labels[same].append(sites.names[i])
    for i in drawn:
        ax.plot(x_top, shown[i], color=colours[i], linewidth=1.1 if smooth else 0.9,
                label=f"{sites.zones[i]} ({', '.join(labels[i])})")
    ax.set_ylabel("carbon intensity (g CO2e / kWh)")
    ax.set_title("Carbon intensity of each site's grid zone, "
                 + ("24-hour moving mean of the hourly values" if smooth else "hourly"))
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
              title="zone (sites), cleanest first")

    if best is not None:
        run = result.policies[best]
        p_job, p_site, p_start, p_end = run.pieces()  # a moved job counts where each piece ran
        busy = gpus_busy_by_hour(p_site, p_start, p_end, result.gpus[p_job], n, hours)
        ax = axes[1]
        ax.stackplot(_hour_axis(result.start, hours, 0.5), busy[order], colors=[colours[i] for i in order],
                     labels=[sites.names[i] for i in order], linewidth=0)
        ax.set_ylabel("GPUs busy (hourly mean, stacked)")
        ax.set_title(f"GPUs busy per site under {best} (the policy with the lowest carbon), "
                     "cleanest sites at the bottom")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
                  title="site, cleanest first\n(bottom of the stack)", ncols=2 if n > 12 else 1)
    axes[-1].set_xlabel("time (UTC)")
    _date_axis(axes[-1])
    fig.savefig(path, dpi=DPI)


def _plot_cumulative(result: SimulationResult, styles: dict[str, dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure

    scale, unit, _ = _units(result)
    fig = Figure(figsize=(11, 5), layout="constrained")
    ax = fig.subplots()
    for name, run in result.policies.items():
        per_hour = _carbon_by_hour(run)
        y = np.concatenate([[0.0], np.cumsum(per_hour)]) / scale
        ax.plot(_hour_axis(result.start, y.size), y, label=name, linewidth=1.4, **styles[name])
    bound_kg = _num(result.offline_bound, "carbon_kg")
    if bound_kg is not None:
        ax.axhline(bound_kg / scale, color="black", linestyle=":", linewidth=1.2,
                   label=f"offline bound, total ({bound_kg / scale:,.1f} {unit})")
    ax.set_ylabel(f"cumulative carbon ({unit} CO2e)")
    ax.set_xlabel("time (UTC)")
    ax.set_title("Carbon emitted so far, per policy (each job's carbon spread over the hours it ran)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    _date_axis(ax)
    fig.savefig(path, dpi=DPI)


def _plot_wait_cdf(result: SimulationResult, styles: dict[str, dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5), layout="constrained")
    ax = fig.subplots()
    for name, run in result.policies.items():
        wait = run.start_s[run.ran] - result.submit_s[run.ran]
        wait = np.sort(np.maximum(wait[np.isfinite(wait)], 1.0))
        if wait.size == 0:
            continue
        frac = np.arange(1, wait.size + 1) / wait.size
        if wait.size > MAX_CDF_POINTS:
            idx = np.unique(np.linspace(0, wait.size - 1, MAX_CDF_POINTS).astype(np.int64))
            wait, frac = wait[idx], frac[idx]
        ax.plot(np.concatenate([[1.0], wait]), np.concatenate([[0.0], frac]), drawstyle="steps-post",
                label=name, linewidth=1.4, **styles[name])
    ax.set_xscale("log")
    ax.set_xlim(left=0.7)  # 1 s and the step up from it stay visible
    low, high = ax.get_xlim()
    marks = {
        seconds: text
        for seconds, text in {60.0: "1 min", HOUR_S: "1 h", 86400.0: "1 day", 7 * 86400.0: "1 week"}.items()
        if low <= seconds <= high
    }
    for seconds in marks:
        ax.axvline(seconds, color="grey", linewidth=0.8, alpha=0.6)
    ax.set_xlim(low, high)
    top = ax.secondary_xaxis("top")
    top.set_xticks(list(marks), list(marks.values()))
    top.tick_params(labelsize="small", colors="grey")
    ax.set_xlabel("wait from submit to start (s, log scale; waits under 1 s drawn at 1 s)")
    ax.set_ylabel("fraction of jobs run that waited at most this long")
    ax.set_title("Wait time, cumulative distribution per policy (jobs that ran)")
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.savefig(path, dpi=DPI)


# -------------------------------------------------------------------------------------------- the page


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #ddd; }
th { background: #f3f3f3; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.bound td { font-style: italic; border-top: 2px solid #999; }
tr.reference td { font-style: italic; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #555; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1,
                row_classes: Sequence[str] | None = None) -> str:
    out = ["<table>", "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>"]
    for r, row in enumerate(rows):
        cls = f' class="{_e(row_classes[r])}"' if row_classes and row_classes[r] else ""
        cells = "".join(
            f'<td class="num">{_e(c)}</td>' if i >= numeric_from else f"<td>{_e(c)}</td>"
            for i, c in enumerate(row)
        )
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</table>")
    return "\n".join(out)


def _sites_table(result: SimulationResult) -> str:
    sites = result.sites
    rows = []
    for i in range(sites.n_sites):
        series = sites.intensity[i]
        mean = float(np.nanmean(series)) if np.isfinite(series).any() else None
        rows.append(
            [
                sites.names[i],
                sites.zones[i],
                sites.regions[i],
                f"{int(sites.capacity_gpus[i]):,}",
                f"{float(sites.usd_per_gpu_hour[i]):,.2f}",
                DASH if mean is None else f"{mean:,.0f}",
            ]
        )
    header = ["site", "grid zone", "cloud region", "GPUs", "USD / GPU-h", "mean intensity (g CO2e / kWh)"]
    return _html_table(header, rows, numeric_from=3)


def _utilisation_table(result: SimulationResult) -> str | None:
    names = list(result.policies)
    by_policy = {}
    for name in names:
        per_site = result.policies[name].metrics.get("utilisation_by_site")
        by_policy[name] = per_site if isinstance(per_site, dict) else {}
    if not any(by_policy.values()):
        return None
    rows = []
    for site in result.sites.names:
        row = [site]
        for name in names:
            value = by_policy[name].get(site)
            row.append(DASH if value is None else f"{100.0 * float(value):.1f} %")
        rows.append(row)
    return _html_table(["site", *names], rows)


def _bound_paragraph(result: SimulationResult) -> str:
    """What the offline bound is, its figures (in the table's units), and the relaxation sentence it came with."""
    bound = result.offline_bound
    if not bound:
        return "<p>No offline bound was computed for this run.</p>"
    scale, unit, energy_decimals = _units(result)
    figures = []
    carbon = _num(bound, "carbon_kg")
    if carbon is not None:
        figures.append(f"the least carbon any schedule of these jobs could emit, {carbon / scale:,.1f} {unit} CO2e")
    cost = _num(bound, "cost_usd")
    if cost is not None:
        figures.append(f"the least cost (found separately), {cost:,.0f} USD")
    energy = _num(bound, "energy_kwh")
    if energy is not None:
        figures.append(f"a lower bound on energy, {energy / 1000.0:,.{energy_decimals}f} MWh")
    text = "The offline bound knows every job and every hour's carbon intensity in advance and gives "
    text += "; ".join(figures) if figures else "no figures"
    solve = _num(bound, "solve_s")
    if solve is not None:
        text += f" (computed in {solve:,.1f} s)"
    text += (". No schedule that ends every job by its deadline can do better than it on carbon or on cost. A "
             "policy that ended jobs after their deadlines is measured (“vs bound”) against the same LP with "
             "those jobs' windows reaching their actual ends, lower than this row (its bound_carbon_kg in the "
             "JSON), so that running late cannot beat the bound.")
    relaxation = str(bound.get("relaxation") or "").strip()
    if relaxation.lower() == "none":
        text += " Relaxation: none beyond the bound's own (the hour-slot model was solved exactly)."
    elif relaxation:
        text += " Relaxation: " + relaxation + ("" if relaxation.endswith(".") else ".")
    text += (" It lets a job's work split over any hours and sites of its window, which no schedule that runs "
             "jobs whole can do.")
    whole = _num(result.whole_job_bound, "carbon_kg")
    about = (" The whole-job bound keeps each job whole, at one site, in one stretch (checkpointable jobs, which "
             "a policy may move, still as divisible work) and relaxes the sites' capacity through a price on each "
             "site-hour")
    if whole is not None:
        steps = _num(result.whole_job_bound, "iterations")
        text += (about + f": {whole / scale:,.1f} {unit} CO2e"
                 + (f", the best of {steps:,.0f} steps of a subgradient search" if steps is not None else "")
                 + ". Every set of prices gives a valid bound; no whole-job schedule inside the jobs' windows "
                 "emits less. A policy that ran jobs late is held to the higher of this bound on its own, wider, "
                 "windows and its fluid bound.")
    elif result.whole_job_bound:
        note = str(result.whole_job_bound.get("note") or "it gave no figure")
        text += about + ": " + note + "."
    return f"<p>{_e(text)}</p>"


def _run_hours(result: SimulationResult) -> int:
    """Whole hours from the start to the last end of any run the page shows: the policies and the whole-job
    oracle, which may run jobs later than every policy (``result.sites`` is cut to the policies' hours, the
    ones the plots draw). The carbon data's hours when no job ran."""
    runs = [*result.policies.values(), *([result.oracle] if result.oracle is not None else [])]
    ends = [float(np.nanmax(run.end_s)) for run in runs if np.isfinite(run.end_s).any()]
    return int(np.ceil(max(ends) / 3600.0)) if ends else result.sites.hours


def _run_facts(result: SimulationResult) -> str:
    hours = _run_hours(result)
    start = result.start.astimezone(UTC)
    n_jobs = int(result.submit_s.size)
    left_out = int(np.count_nonzero(result.left_out))
    text = (
        f"{n_jobs - left_out:,} jobs replayed ({left_out:,} more of the trace left out for every policy: no site fits "
        "them even when empty, in GPUs, GPU model or latency objective) over "
        f"{result.sites.n_sites} sites for {hours:,} hours from {start:%Y-%m-%d %H:%M} UTC, "
        f"under {len(result.policies)} policies: {', '.join(result.policies)}."
    )
    return f"<p>{_e(text)}</p>"


def _oracle_paragraph(result: SimulationResult) -> str:
    """What the whole-job oracle row is, when the run has one."""
    if result.oracle is None:
        return ""
    guided = bool(result.oracle.metrics.get("guided_by_shadow_prices"))
    return "<p>" + _e(
        "The whole-job oracle is a schedule, not a policy: it runs every job whole at one site, choosing its "
        "site and start knowing every job's true run time and every future hour's carbon intensity"
        + (" and guided by the offline bound's price of each site-hour's capacity" if guided else "")
        + ". It shows what foresight could buy a whole-job schedule; the offline bound, below it, also "
        "lets work split over hours and sites."
    ) + "</p>"


def write_html(result: SimulationResult, directory: str | Path) -> Path:
    """Write ``index.html`` and its three PNG plots into ``directory`` (made if missing); return the page's path.

    The page holds the metrics table (as :func:`format_table`), the plots with a sentence on how to read
    each, the sites, utilisation per site and policy, the run's report lines and the offline bound's
    relaxation. Every string from the run is HTML-escaped; the images are referenced by relative paths,
    so the directory can be moved or served as it is.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    best = _best_policy(result)
    styles = _policy_styles(list(result.policies))
    _plot_intensity(result, best, out / "intensity.png")
    _plot_cumulative(result, styles, out / "cumulative_carbon.png")
    _plot_wait_cdf(result, styles, out / "wait_cdf.png")

    header, rows, verdict = _table_cells(result)
    # the reference rows under the policies: the first under a rule, all in italics
    classes = [""] * len(result.policies) + ["bound"] + ["reference"] * (len(rows) - len(result.policies) - 1)
    utilisation = _utilisation_table(result)

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>heliotrope simulation report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>heliotrope simulation report</h1>",
        _run_facts(result),
        "<h2>Results per policy</h2>",
        ("<p class=\"note\">Carbon and energy are totals over the jobs each policy ran; “vs bound” is how much "
        "more carbon than the offline bound the policy emitted, and “vs whole-job” than the whole-job bound "
        "(the last rows, below; a policy that ended jobs after their deadlines against each bound on its own, "
        "wider, windows, as the paragraph under the table says); wait p95 is the 95th percentile of "
        "the time from submission to start; utilisation is the share of the federation's GPU-hours in use. "
        f"“{_e(DASH)}” marks a figure the run did not produce.</p>"),
        _html_table(header, rows, row_classes=classes),
        f"<p><strong>{_e(verdict)}</strong></p>",
        _bound_paragraph(result),
        _oracle_paragraph(result),
        "<h2>Carbon intensity and where the jobs ran</h2>",
        "<p>Top: the grid's carbon intensity (g CO2e per kWh) in each site's zone, "
        + ("as a 24-hour moving mean (runs over three weeks)" if result.sites.hours > SMOOTH_AFTER_H
           else "hour by hour")
        + "; lower is cleaner, and the gaps between the lines are what a carbon-aware policy can exploit. Bottom"
        + (
            f", for {_e(best)} (the policy with the lowest carbon): the GPUs busy at each site, as the "
            "hourly mean, stacked so the top edge is the whole federation's load. Read the two panels "
            "together: a good policy puts its load where, and when, the top panel is low."
            if best is not None
            else ": nothing, as the run has no policy."
        )
        + "</p>",
        '<img src="intensity.png" alt="carbon intensity per zone and GPUs busy per site over time">',
        "<h2>Cumulative carbon</h2>",
        (f"<p>The carbon each policy has emitted so far ({_units(result)[1]} CO2e), each job's carbon spread "
        "evenly over the hours it ran; each curve ends at the policy's total. A lower curve is better; the dotted "
        "line is the offline bound's total, which no online policy can get below. Baseline policies are dashed.</p>"),
        '<img src="cumulative_carbon.png" alt="cumulative carbon per policy over time">',
        "<h2>Wait times</h2>",
        ("<p>For each policy, the fraction of the jobs it ran (y) that waited at most a given time (x, "
        "seconds on a log scale) from submission to start; waits under a second are drawn at 1 s. A curve "
        "further up and to the left means shorter waits; where a curve reaches 0.95 is the wait p95 in the "
        "table. Grey lines mark a minute, an hour, a day and a week.</p>"),
        '<img src="wait_cdf.png" alt="cumulative distribution of wait times per policy">',
        "<h2>Sites</h2>",
        ("<p>Each simulated site, its grid zone and cloud region, its GPUs, the price of its GPUs (US dollars "
        "per GPU-hour) and the mean carbon intensity of its zone over the run.</p>"),
        _sites_table(result),
    ]
    if utilisation is not None:
        parts += [
            "<h2>Utilisation per site</h2>",
            "<p>The share of each site's GPU-hours in use over the run, per policy.</p>",
            utilisation,
        ]
    parts.append("<h2>About this run's inputs</h2>")
    if result.report:
        parts.append("<ul>" + "".join(f"<li>{_e(line)}</li>" for line in result.report) + "</ul>")
    else:
        parts.append("<p>The run reported nothing about its inputs.</p>")
    parts += [
        '<p class="note">Written by heliotrope simulate.</p>',
        "</body></html>",
        "",
    ]
    index = out / "index.html"
    index.write_text("\n".join(parts), encoding="utf-8")
    return index
