"""Job dependencies (``JobSpec.after``, as Slurm's ``--dependency=afterok``): the words a waiting job's reason uses,
and the rule for what a dependency's state means.

A job that runs after others is stored ``queued`` with ``Job.waiting`` set, and held out of the scheduling queue
(``jobs.ActiveJobs``) until every job it names has succeeded; the leader's book then releases it
(``JobBook.settle_waiting``) into the queue as any new job. Should one of them fail or be cancelled, it fails at
once, and so do the jobs waiting for it, down the chain. The retention (``broker.job_retention_h``) keeps a
finished job that a waiting job runs after (``Broker._prune_round``); one no longer in the store all the same
(deleted by a leader of an earlier release) cannot be told to have succeeded: the job fails, saying so.
Dependencies name existing jobs only, so they form no cycle.

Its age in the queue counts from its submission (``created_at``), not from its release: a pipeline submitted at
once keeps its place against work submitted after it (priority and fair share order the queue first, as for any
job). Nothing to turn off: a job without ``after`` never waits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from broker.models import JobState

NEVER = frozenset({JobState.FAILED, JobState.CANCELLED})
"""A dependency's states after which the job waiting for it can never run."""


def _jobs(ids: Sequence[str]) -> str:
    return "job" if len(ids) == 1 else "jobs"


def waiting_reason(unmet: Sequence[str], states: Mapping[str, JobState | None]) -> str:
    """A waiting job's reason: the jobs it still waits for, each with its state (as last read)."""
    listed = ", ".join(f"{dep} ({states.get(dep) or 'unknown'})" for dep in unmet)
    return f"waiting for {_jobs(unmet)} {listed} to succeed (after)"


def never_reason(dep: str, state: JobState | None) -> str | None:
    """Why a job that runs after ``dep``, found in ``state`` (None: not in the store), can never run; None while it
    may still run."""
    if state is None:
        return (f"job {dep} it runs after is no longer in the store (a finished job is deleted "
                "broker.job_retention_h after it ended), so it cannot be told to have succeeded; it will never run "
                "(after)")
    if state in NEVER:
        return f"job {dep} it runs after was {state}; it will never run (after)"
    return None


def released_reason(after: Sequence[str]) -> str:
    """A released job's reason, until a pass decides it."""
    return f"waiting for a placement: {_jobs(after)} {', '.join(after)} it runs after succeeded (after)"
