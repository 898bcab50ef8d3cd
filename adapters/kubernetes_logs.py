"""What an attempt printed at a Kubernetes site: the log of its Pod's container (``adapters.base.LogReader``).

The attempt's Pods are those with the adapter's labels (``heliotrope.io/site``, ``heliotrope.io/job-id``,
``heliotrope.io/attempt``; the full job id in the ``heliotrope.io/job-id`` annotation where a label had to
shorten it), listed across namespaces and checked again here (a cluster, or an emulator, may not filter). The
newest one (by ``creationTimestamp``) is read: a Job of ``backoffLimit: 0`` has one, unless the cluster made
another after a disruption. Its container is ``job`` (the one the adapter's manifest makes; another a webhook
injected, such as a service mesh's proxy, is not read), else the Pod's only or first container.

The API server answers ``tailLines`` itself (the kubelet reads the container's log file); the bytes are cut
here, the last ``limit_bytes`` of the answer kept as it streams in, since the API server's ``limitBytes`` stops
its answer after that many (it would keep the start of the tail, and leave out the newest lines). The text is cut
again to the lines to be sure, and ``truncated`` is set where it may have been cut (a log as long as the tail, or
longer than the bytes). A Pod not started yet has no log (the API server answers 400: the container waits), nor one
deleted: a Job that ended is deleted with its Pods once the broker has taken its outcome, so the adapter reads the
end of its log just before and keeps it in memory (``KubernetesSite._keep_log``: the latest ended attempts',
32 MiB in all; not across its restarts, nor for attempts stopped or lost). RBAC: ``get`` on ``pods/log``.

Followed (``follow_logs``, ``kubectl logs -f``): the API server's ``follow`` read of the same container, relayed as it
comes until the kubelet ends it (the container ended, or the Pod went). Its tail is what a read without ``follow``
would give: where that was cut to ``limit_bytes``, the followed read asks for as many lines as fit them
(:func:`lines_within`), since ``limitBytes`` would end the stream there.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from adapters.base import JobLogs, tail_text
from adapters.kubernetes_nodes import ATTEMPT_LABEL, JOB_ANNOTATION, JOB_LABEL, _timestamp

CONTAINER = "job"  # the container the adapter's Job manifest names


def attempt_selector(site_label: str, job_label: str, attempt: int) -> str:
    return f"heliotrope.io/site={site_label},{JOB_LABEL}={job_label},{ATTEMPT_LABEL}={attempt}"


def newest_pod(pods: list[dict[str, Any]], site_label: str, job_id: str, job_label: str,
               attempt: int) -> dict[str, Any] | None:
    """The newest Pod of the attempt among ``pods`` (their labels and annotation checked), or None."""
    mine = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
        if (labels.get("heliotrope.io/site") == site_label and labels.get(JOB_LABEL) == job_label
                and labels.get(ATTEMPT_LABEL) == str(attempt) and notes.get(JOB_ANNOTATION, job_id) == job_id):
            mine.append(pod)
    if not mine:
        return None
    return max(mine, key=lambda p: (_timestamp((p.get("metadata") or {}).get("creationTimestamp")) or 0.0,
                                    (p.get("metadata") or {}).get("name") or ""))


def container_of(pod: dict[str, Any]) -> str | None:
    """The container whose log is the attempt's: ``job``, else the only or first one (None: none listed)."""
    names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or [] if c.get("name")]
    if CONTAINER in names:
        return CONTAINER
    return names[0] if names else None


def as_logs(raw: bytes, dropped: bool, tail_lines: int | None, limit_bytes: int, source: str) -> JobLogs:
    """The API server's answer (``raw``: its end, ``dropped`` where bytes before it were left out) as
    :class:`JobLogs`: decoded (bytes that are no UTF-8 replaced, a character cut in two at the start dropped), cut
    again to the limits, and ``truncated`` where anything may have been left out (a log as long as the tail)."""
    if dropped:  # (the cut may have split a character: the rest of it goes)
        start = 0
        while start < min(3, len(raw)) and 0x80 <= raw[start] < 0xC0:
            start += 1
        raw = raw[start:]
    text = raw.decode("utf-8", errors="replace")
    kept, cut = tail_text(text, tail_lines, limit_bytes)
    lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    full = cut or dropped or (tail_lines is not None and lines >= tail_lines)
    return JobLogs(kept, full, source)


def lines_within(raw: bytes) -> int:
    """How many whole lines the end of a log cut to its last bytes (``raw``) holds, as ``tailLines`` counts them: all
    but the first, which the cut split (a last line without its newline yet counts)."""
    return max(raw.count(b"\n") - 1 + (0 if raw.endswith(b"\n") or not raw else 1), 0)


async def once(text: str) -> AsyncGenerator[str, None]:
    """A followed log that has ended: ``text``, then the end."""
    if text:
        yield text
