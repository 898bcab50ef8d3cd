"""Job dependencies, as Slurm's ``--dependency``: ``JobSpec.after`` (``afterok``: each named job must succeed),
``JobSpec.after_any`` (``afterany``: each must end, however) and ``JobSpec.after_failed`` (``afternotok``: each must
fail or be cancelled). The words a waiting job's reason uses, and the rule for what a dependency's state means.

A job that runs after others is stored ``queued`` with ``Job.waiting`` set, and held out of the scheduling queue
(``jobs.ActiveJobs``) until every condition holds; the leader's book then releases it (``JobBook.settle_waiting``)
into the queue as any new job. Should one become impossible (a job in ``after`` fails or is cancelled, one in
``after_failed`` succeeds), it fails at once, and so do the jobs waiting for it with ``after``, down the chain (a
job waiting for it with ``after_failed`` or ``after_any`` is released instead). The retention
(``broker.job_retention_h``) keeps a finished job that a waiting job runs after (``Broker._prune_round``); one no
longer in the store all the same (deleted by a leader of an earlier release) ended, which meets ``after_any``, but
cannot be told to have succeeded or failed: a job waiting for it with ``after`` or ``after_failed`` fails, saying
so. Dependencies name existing jobs only, so they form no cycle; a job is named in one list at most.

Its age in the queue counts from its submission (``created_at``), not from its release: a pipeline submitted at
once keeps its place against work submitted after it (priority and fair share order the queue first, as for any
job). Nothing to turn off: a job without dependencies never waits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from broker.models import JobSpec, JobState

Kind = Literal["after", "after_any", "after_failed"]
KINDS: tuple[Kind, ...] = ("after", "after_any", "after_failed")
"""The spec's lists of dependencies, in the order reasons and checks name them."""

NEVER = frozenset({JobState.FAILED, JobState.CANCELLED})
"""A dependency's states after which a job waiting for it with ``after`` can never run, and which meet
``after_failed``."""

_TO = {"after": "succeed", "after_any": "end", "after_failed": "fail or be cancelled"}
_DID = {"after": ("succeeded", "succeeded"), "after_any": ("ended", "ended"),
        "after_failed": ("failed or was cancelled", "failed or were cancelled")}  # (one job, more)


def _jobs(ids: Sequence[str]) -> str:
    return "job" if len(ids) == 1 else "jobs"


def conditions(spec: JobSpec) -> list[tuple[str, Kind]]:
    """Each job the spec runs after, with the list that names it (``after`` first, then ``after_any``, then
    ``after_failed``)."""
    return [(dep, kind) for kind in KINDS for dep in getattr(spec, kind)]


def dependencies(spec: JobSpec) -> list[str]:
    """The ids of every job the spec runs after, whatever the list."""
    return [dep for dep, _ in conditions(spec)]


def met(kind: Kind, state: JobState | None) -> bool:
    """Whether a dependency in ``state`` (None: no longer in the store) meets its condition. A job gone from the
    store ended (only finished jobs are deleted): that meets ``after_any``, and nothing else."""
    if kind == "after":
        return state == JobState.SUCCEEDED
    if kind == "after_any":
        return state is None or state.terminal
    return state in NEVER


def unmet(spec: JobSpec, states: Mapping[str, JobState | None]) -> list[tuple[str, Kind]]:
    """The spec's conditions that do not hold for its dependencies' ``states``, in :func:`conditions`' order."""
    return [(dep, kind) for dep, kind in conditions(spec) if not met(kind, states[dep])]


def waiting_reason(waits: Sequence[tuple[str, Kind]], states: Mapping[str, JobState | None]) -> str:
    """A waiting job's reason: the jobs it still waits for (``waits``: :func:`unmet`), each with its state (as last
    read), by the condition it waits for: ``waiting for job A (running) to succeed (after); job B (queued) to end
    (after_any)``."""
    clauses = []
    for kind in KINDS:
        ids = [dep for dep, k in waits if k == kind]
        if ids:
            listed = ", ".join(f"{dep} ({states.get(dep) or 'unknown'})" for dep in ids)
            clauses.append(f"{_jobs(ids)} {listed} to {_TO[kind]} ({kind})")
    return "waiting for " + "; ".join(clauses)


def never_reason(dep: str, state: JobState | None, kind: Kind = "after") -> str | None:
    """Why a job that runs after ``dep`` (named in its list ``kind``), found in ``state`` (None: not in the store),
    can never run; None while it may still run."""
    if kind == "after_any":
        return None  # (any end meets it, and a job no longer in the store ended)
    if state is None:
        told = "succeeded" if kind == "after" else "failed"
        return (f"job {dep} it runs after is no longer in the store (a finished job is deleted "
                f"broker.job_retention_h after it ended), so it cannot be told to have {told}; it will never run "
                f"({kind})")
    if kind == "after" and state in NEVER:
        return f"job {dep} it runs after was {state}; it will never run (after)"
    if kind == "after_failed" and state == JobState.SUCCEEDED:
        return (f"job {dep} it runs after succeeded, and it runs only if that job fails or is cancelled; it will "
                "never run (after_failed)")
    return None


def released_reason(spec: JobSpec) -> str:
    """A released job's reason, until a pass decides it."""
    clauses = []
    for kind in KINDS:
        ids: list[str] = getattr(spec, kind)
        if ids:
            clauses.append(f"{_jobs(ids)} {', '.join(ids)} it runs after {_DID[kind][len(ids) > 1]} ({kind})")
    return "waiting for a placement: " + "; ".join(clauses)
