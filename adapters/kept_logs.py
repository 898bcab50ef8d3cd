"""The ends of ended attempts' logs that a site adapter keeps once their Pods are gone, bounded in bytes, and kept in
its ``state_dir`` where it has one, so that they outlive a restart of the adapter (a broker upgrade, a crash).

A Kubernetes site deletes an ended attempt's Job, and its Pods with it, once the broker has the outcome; the end of
the log is read first and kept (``adapters.kubernetes.KubernetesSite._keep_log``). Kept in memory only, a restart
of the adapter lost every one of them, and ``heliotrope logs`` of a job that failed an hour before answered that
its Pod was gone. Kept here, in ``STATE_DIR/SITE/logs/``: one file per attempt (its bytes as UTF-8, written
atomically: a crash leaves the old set or the new one), and ``index.json``, the attempts in the order they were
kept (the oldest go first once the bytes kept pass the bound), with whether each was cut and where it was read
from. At start the index is read and each file in it loaded (at most the bound: 32 MiB by default); a file that is
missing or cannot be read is left out with a warning, an index that cannot be read is moved aside
(``index.json.unreadable``) and the adapter starts with none; a file no index names is deleted (where the folder
is read-only, left with a warning). A write that fails is logged, and the log is still kept in memory: reading it
must not fail a deletion; the files the bound dropped meanwhile are deleted by the next write that works. Once the
site leaves (:meth:`KeptLogs.forget`) the folder is deleted, after a write under way, and none is written again.

Without a ``state_dir`` (tests, or an operator who gives none) they are kept in memory only, as before. Files are
named by a digest of (job id, attempt), so no id, whatever its characters, names a path.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from adapters.site_state import read_or_set_aside, write_atomically

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (job id, attempt)


@dataclass(frozen=True, slots=True)
class KeptLog:
    """The end of an ended attempt's log: as UTF-8, the bytes the bound counts (a str takes up to 4 bytes for each
    character: all of them, where one is an emoji), whether lines before it were left out, and where it was read."""

    data: bytes
    truncated: bool
    source: str | None


class _Entry(BaseModel):
    """One kept log in ``index.json``."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # (what a later release adds is passed over)

    job_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)
    file: str = Field(pattern=r"^[0-9a-f]{32}\.log$")
    truncated: bool = False
    source: str | None = None


_INDEX = TypeAdapter(list[_Entry])


def file_name(key: Key) -> str:
    """The file an attempt's log is kept in: a digest of its job id and attempt."""
    return hashlib.blake2b(f"{key[0]}\0{key[1]}".encode(), digest_size=16).hexdigest() + ".log"


class KeptLogs:
    """The logs kept, by (job id, attempt), oldest first; in ``folder`` when given (else in memory only)."""

    def __init__(self, folder: Path | None, site: str) -> None:
        self.folder = folder
        self.site = site
        self._logs: collections.OrderedDict[Key, KeptLog] = collections.OrderedDict()
        self.bytes = 0
        self._lock = asyncio.Lock()  # one write of the folder at a time: the index is the latest order
        # held by a write's thread, and by forget: a write under way as the site leaves cannot bring its folder back
        self._disk = threading.Lock()
        self._stale: set[Key] = set()  # dropped by the bound, their files not deleted yet (a write failed)
        if folder is not None:
            self._load(folder)

    def _load(self, folder: Path) -> None:
        index = folder / "index.json"
        entries = read_or_set_aside(index, _INDEX, f"site {self.site}'s kept logs", "keeping none from before") or []
        for e in entries:
            try:
                data = (folder / e.file).read_bytes()
            except OSError as err:
                log.warning("site %s: the kept log of attempt %d of job %s cannot be read (%s); left out",
                            self.site, e.attempt, e.job_id, err)
                continue
            self._put((e.job_id, e.attempt), KeptLog(data, e.truncated, e.source))
        named = {e.file for e in entries}
        for path in folder.glob("*.log"):  # (a crash after a file was written, before the index named it)
            if path.name not in named:
                try:
                    path.unlink(missing_ok=True)
                except OSError as err:  # (a read-only state folder: the adapter starts all the same)
                    log.warning("site %s: %s, a kept log no index names, cannot be deleted (%s)", self.site, path,
                                err)
        if self._logs:
            log.info("site %s: %d ended attempts' logs kept from before the start (%d bytes)", self.site,
                     len(self._logs), self.bytes)

    def get(self, key: Key) -> KeptLog | None:
        return self._logs.get(key)

    def __len__(self) -> int:
        return len(self._logs)

    def _put(self, key: Key, kept: KeptLog) -> None:
        old = self._logs.pop(key, None)
        self.bytes -= len(old.data) if old is not None else 0
        self._logs[key] = kept
        self.bytes += len(kept.data)

    def _evict(self, limit_bytes: int) -> list[Key]:
        gone = []
        while self._logs and self.bytes > limit_bytes:
            key, old = self._logs.popitem(last=False)
            self.bytes -= len(old.data)
            gone.append(key)
        return gone

    async def put(self, key: Key, kept: KeptLog, limit_bytes: int) -> None:
        """Keep ``kept`` as ``key``'s log, the newest; the oldest go while the logs kept pass ``limit_bytes``."""
        self._put(key, kept)
        gone = self._evict(limit_bytes)
        if self.folder is None:
            return
        self._stale.update(gone)
        async with self._lock:
            kept_now = self._logs.get(key)
            entries = [_Entry(job_id=k[0], attempt=k[1], file=file_name(k), truncated=v.truncated, source=v.source)
                       for k, v in self._logs.items()]  # (read here: the loop may change them while a thread writes)
            self._stale.difference_update(self._logs)  # (one kept again since is no longer to be deleted)
            stale = list(self._stale)  # (with those a failed write left: the folder keeps to the bound once one works)
            try:
                await asyncio.to_thread(self._write, key, kept_now, entries, stale)
            except OSError as e:
                log.error("site %s: the log of attempt %d of job %s could not be kept in %s (%s); it is kept in "
                          "memory, until the adapter restarts", self.site, key[1], key[0], self.folder, e)
            else:
                self._stale.difference_update(stale)

    def _write(self, key: Key, kept: KeptLog | None, entries: list[_Entry], gone: list[Key]) -> None:
        with self._disk:
            folder = self.folder
            if folder is None:  # (the site left while this write waited: its folder stays gone)
                return
            if kept is not None:  # (None: already gone again, by a later put's bound)
                write_atomically(folder / file_name(key), kept.data)
            write_atomically(folder / "index.json", _INDEX.dump_json(entries))
            for k in gone:  # (after the index: a crash between leaves a file no index names, not the reverse)
                (folder / file_name(k)).unlink(missing_ok=True)

    def forget(self) -> None:
        """The site leaves the federation: the logs kept go, and their folder (a new site of its name starts with
        none)."""
        self._logs.clear()
        self._stale.clear()
        self.bytes = 0
        with self._disk:  # (after a write under way in its thread, which would make the folder again)
            folder, self.folder = self.folder, None  # (and none after: the logs kept from now on, in memory only)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
