"""What a site adapter keeps in its ``state_dir`` so that it outlives a restart: small JSON files, one per kind.

Each file is written atomically (a temporary file in the same folder, flushed and synced, then renamed over
the old one), so a crash leaves the old or the new file, never half of one. A file that cannot be read at
start (edited by hand, a disk error) is moved aside as ``NAME.unreadable``, with a logged error, and the
adapter starts without it: a site must come up.

- :class:`StopJournal`: the stops an adapter began (the broker's ``preempt``, or the site's own preemption)
  whose ``preempted`` event the broker has not yet taken. A stop ends when the job's Pods have gone, which
  may happen while no adapter watches (the broker restarting); the adapter that starts next reports it from
  here, with the run up to the stop, so the job keeps its checkpoint's work rather than starting over as a
  lost attempt. (:mod:`adapters.quota_store` keeps the operator's quota changes the same way.) The Kubernetes
  adapter also keeps a copy in the cluster (``state_namespace``, :mod:`adapters.kubernetes_stops`), for a broker
  replica with another state folder that takes over: it follows each change through ``StopJournal.listener``,
  and what it finds there at start is joined to the file's (``StopJournal.merge``).
- :class:`UsageJournal`: the site's usage history, which its time-based fair share weighs (the decayed
  GPU-hours of each tenant over the window, :class:`policies.quota.QuotaBook`). Saved at most once a minute
  (``every_s``) as the broker or agent reads the site's state, and when the adapter closes; taken by the
  site's ledgers at start, with the jobs still running counted from the save on, so a restart does not give
  every tenant a clean slate.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from broker.models import STORED, UtcDatetime
from policies.quota import QuotaBook, UsageHistory

log = logging.getLogger(__name__)

T = TypeVar("T")


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path``, or (an OSError) the file as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_or_set_aside(path: Path | None, shape: TypeAdapter[T], what: str, starting: str) -> T | None:
    """``path``'s JSON as ``shape``; None when there is no such file, or when it cannot be read, in which case
    it is moved aside (``NAME.unreadable``) with an error naming ``what`` it held and what the adapter does
    instead (``starting``)."""
    if path is None or not path.exists():
        return None
    try:
        return shape.validate_json(path.read_bytes(), context=STORED)  # (what an earlier release wrote loads)
    except (OSError, ValidationError, ValueError) as e:
        aside = path.with_suffix(path.suffix + ".unreadable")
        log.error("cannot read %s in %s (%s); moved to %s, %s", what, path, e, aside, starting)
        try:
            os.replace(path, aside)
        except OSError as err:
            log.error("could not move %s aside: %s", path, err)
        return None


class KeptStop(BaseModel):
    """A stop an adapter began: why, since when the attempt ran (None: it never ran), and when the stop began."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str
    running_since: UtcDatetime | None
    at: UtcDatetime
    job_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)

    @property
    def run_s(self) -> float:
        """Seconds the attempt ran before its stop began: the work its checkpoint holds, as far as is known."""
        return max((self.at - self.running_since).total_seconds(), 0.0) if self.running_since is not None else 0.0


_STOPS = TypeAdapter(list[KeptStop])


class StopJournal:
    """The stops of one site not yet taken by the broker, by (job id, attempt); in ``path`` when given (else in
    memory only). A write that fails is logged and kept in memory: a stop goes ahead without its record.

    ``listener``, when set, hears each change after the file is written: the stop added (or replaced), or None
    for one removed (the Kubernetes adapter's copy in the cluster follows it)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        found = read_or_set_aside(path, _STOPS, "the stops not yet reported", "reporting none from before") or []
        self._stops: dict[tuple[str, int], KeptStop] = {(s.job_id, s.attempt): s for s in found}
        self.listener: Callable[[tuple[str, int], KeptStop | None], None] | None = None

    def items(self) -> list[tuple[tuple[str, int], KeptStop]]:
        return sorted(self._stops.items())

    def keys(self) -> set[tuple[str, int]]:
        return set(self._stops)

    def add(self, key: tuple[str, int], reason: str, running_since: datetime | None, at: datetime) -> None:
        stop = KeptStop(job_id=key[0], attempt=key[1], reason=reason, running_since=running_since, at=at)
        self._stops[key] = stop
        self._save()
        if self.listener is not None:
            self.listener(key, stop)

    def remove(self, key: tuple[str, int]) -> None:
        if self._stops.pop(key, None) is not None:
            self._save()
            if self.listener is not None:
                self.listener(key, None)

    def merge(self, stops: Iterable[KeptStop]) -> list[KeptStop]:
        """Join ``stops`` (kept elsewhere: another replica's, through the cluster) to these, by (job id,
        attempt); one known here already stays as it is. Returns those that were new here (kept in the file;
        the listener does not hear them: they came from where it writes)."""
        new = [s for s in stops if (s.job_id, s.attempt) not in self._stops]
        for s in new:
            self._stops[(s.job_id, s.attempt)] = s
        if new:
            self._save()
        return new

    def forget(self) -> None:
        """The site leaves the federation: drop the stops kept, and their file, and keep none in it from now on
        (so a new site of its name takes up none of them as its own). The listener hears nothing more."""
        self._stops.clear()
        self.listener = None
        path, self.path = self.path, None
        if path is not None:
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                log.warning("cannot remove the stops not yet reported %s (%s); a new site of its name would report "
                            "them as its own: delete it", path, e)

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            if self._stops:
                write_atomically(self.path, _STOPS.dump_json([s for _, s in self.items()], indent=1))
            else:
                self.path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("cannot write the stops not yet reported to %s (%s); a restart before they are "
                        "reported takes their attempts for lost", self.path, e)


class _KeptAccount(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    tenant: str = Field(min_length=1)
    pool: str | None  # the model the tenant's quota counts, None for any
    gpu_s: dict[int, float]  # GPU-seconds per period index


class KeptUsage(BaseModel):
    """A site's usage history as kept in ``usage.json`` (:meth:`policies.quota.QuotaBook.history`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # (what a later release adds is read past)

    v: int = 1
    bucket_s: float = Field(gt=0)
    origin: float | None
    saved_at: float
    accounts: list[_KeptAccount]

    @classmethod
    def of(cls, history: UsageHistory) -> KeptUsage:
        return cls(bucket_s=history.bucket_s, origin=history.origin, saved_at=history.saved_at,
                   accounts=[_KeptAccount(tenant=t, pool=p, gpu_s=dict(b)) for (t, p), b in
                             sorted(history.usage.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))])

    def history(self) -> UsageHistory:
        return UsageHistory(self.bucket_s, self.origin, self.saved_at,
                            {(a.tenant, a.pool): a.gpu_s for a in self.accounts})


_USAGE = TypeAdapter(KeptUsage)

USAGE_SAVE_EVERY_S = 60.0
"""How often, at most, a site writes its usage history: a crash forgets at most this much of it."""


class UsageJournal:
    """A site's usage history in ``path`` (None: kept nowhere, and :meth:`restore` takes nothing but what it is
    handed). A write that fails is logged; the site goes on (its fair share then forgets the history at its next
    restart). ``mirror``, when set, gets each save's document too (the Kubernetes adapter's copy in the cluster,
    :class:`adapters.kubernetes_stops.ClusterUsage`)."""

    def __init__(self, path: Path | None, site: str, every_s: float = USAGE_SAVE_EVERY_S) -> None:
        self.path = path
        self.site = site
        self.every_s = every_s
        self.mirror: Callable[[bytes], None] | None = None
        self._saved_at: float | None = None
        self._forgotten = False

    def restore(self, book: QuotaBook, now: float, also: bytes | None = None, where: str = "") -> bool:
        """Give ``book`` (a site's first ledgers since its start, its running jobs entered) the kept history, or
        ``also`` (a copy kept ``where`` else, as written) where that one was saved later; whether it took one."""
        kept, source = read_or_set_aside(self.path, _USAGE, "the usage history", "counting usage from now"), self.path
        if also is not None:
            try:
                other = _USAGE.validate_json(also, context=STORED)
            except (ValidationError, ValueError) as e:
                log.error("site %s: the usage history in %s cannot be read (%s); not taken", self.site, where,
                          str(e).splitlines()[0])
            else:
                if kept is None or other.saved_at > kept.saved_at:
                    kept, source = other, where
        if kept is None:
            return False
        why_not = book.restore(kept.history(), now)
        if why_not is not None:
            log.warning("site %s: the usage history in %s is not taken: %s; the fair share counts usage from now",
                        self.site, source, why_not)
            return False
        log.info("site %s: usage history restored from %s (saved %.0f s ago)", self.site, source,
                 max(0.0, now - kept.saved_at))
        return True

    def save(self, book: QuotaBook, now: float, force: bool = False) -> None:
        """Write ``book``'s history, unless one was written less than ``every_s`` ago (``force``: at close)."""
        if (self.path is None and self.mirror is None) or self._forgotten or (
                not force and self._saved_at is not None and now - self._saved_at < self.every_s):
            return
        self._saved_at = now
        data = _USAGE.dump_json(KeptUsage.of(book.history(now)))
        if self.mirror is not None:
            self.mirror(data)
        if self.path is None:
            return
        try:
            write_atomically(self.path, data)
        except OSError as e:
            log.warning("site %s: cannot write the usage history to %s (%s); a restart would forget it",
                        self.site, self.path, e)

    def forget(self) -> None:
        """The site leaves the federation: drop the kept history, and keep none from now on (so a new site of
        its name starts afresh)."""
        self._forgotten = True
        if self.path is not None:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as e:
                log.warning("site %s: cannot remove the usage history %s (%s)", self.site, self.path, e)
