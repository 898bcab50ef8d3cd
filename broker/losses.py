"""Lost attempts told from a job's stored transitions, and the reason a job fails with at its last allowed loss.

A loss (a site that went away or forgot the attempt across a restart, a Kubernetes drain, eviction or node loss, a
Pod the cluster could not place and the adapter withdrew, a remote site's lease run out) requeues the job with a
reason ``lost_reason`` writes; ``lost_attempts`` reads them back from the job's transitions (``Store.job_events``),
so the count needs nothing stored beside them, holds across restarts and takeovers, and takes in the losses
earlier releases stored. :class:`broker.lifecycle.Lifecycle` fails a job at its ``max_lost_attempts``-th loss
(0: no bound). Preemptions, moves and refusals at dispatch are requeued with other reasons, and do not count.
"""

from __future__ import annotations

import re

from broker.models import JobState

_LOST = re.compile(r"(?P<site>\S+) (?:lost|no longer knows) attempt \d+"
                   r"|site (?P<gone>\S+) is no longer registered")
"""A stored transition that tells a loss (its reason, as ``lost_reason`` writes it, or as an earlier release wrote
the requeue of an attempt its site forgot across a restart or of one on a site no longer registered)."""


def lost_reason(site: str, attempt: int, why: str) -> str:
    """The reason of the requeue of an attempt ``site`` lost: how ``lost_attempts`` tells it in the history."""
    return f"{site} lost attempt {attempt}: {why}"


def lost_attempts(history: list[dict[str, object]]) -> dict[int, str]:
    """The attempts a job lost (attempt -> the site that lost it), from its stored transitions (oldest first,
    ``Store.job_events``): each requeue whose reason tells a loss."""
    lost: dict[int, str] = {}
    for ev in history:
        if ev["state"] != JobState.QUEUED or not isinstance(ev["reason"], str):
            continue
        m = _LOST.match(ev["reason"])
        if m is not None:
            lost[int(str(ev["attempt"]))] = m["site"] or m["gone"]
    return lost


def losses_told(lost: dict[int, str], cap: int) -> str:
    """Why a job lost ``cap`` times fails: how many, where, and what to do."""
    by_site: dict[str, list[int]] = {}
    for attempt, site in sorted(lost.items()):
        by_site.setdefault(site, []).append(attempt)
    where = ", ".join(f"{len(a)} at {site} (attempt{'s' if len(a) > 1 else ''} {', '.join(map(str, a))})"
                      for site, a in sorted(by_site.items(), key=lambda kv: (-len(kv[1]), kv[0])))
    return (f"{len(lost)} attempt{'s' if len(lost) > 1 else ''} lost, the most max_lost_attempts allows ({cap}): "
            f"{where}; giving up, as it would likely be lost again (a larger max_lost_attempts, or 0, lets it go on)")
