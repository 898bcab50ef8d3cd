"""The Kubernetes adapter's stops not yet reported, kept in the cluster too (``state_namespace``).

:class:`adapters.site_state.StopJournal` keeps them in the adapter's ``state_dir``, which only the process
that wrote it reads. Broker replicas each run their own adapters with their own folder, so a replica that takes
over would not know a stop the one before began, and would take its attempt for lost once its Pods had gone
(the job starting over instead of from its checkpoint). With ``state_namespace`` set, the adapter also keeps
them in the ConfigMap ``heliotrope-stops-<site>`` of that namespace (:func:`config_map_name`), as the same JSON
list under the key ``stops.json``, so the adapter of whichever replica starts next finds them.

- At start the adapter reads the ConfigMap (:meth:`ClusterStops.read`) and joins what it holds to its file's
  stops (by job id and attempt) before it adopts them; the file's stops the ConfigMap lacks are written to it.
- Each change to the journal (a stop begun, one the broker has taken) is queued (:meth:`ClusterStops.put`) and
  written by one task, in the background: the stop goes ahead at once, and the changes queued meanwhile go out
  in one write (the latest change of each stop wins). A write reads the ConfigMap, applies the queued changes
  to the list it holds and writes it back on condition that nobody wrote in between (its ``resourceVersion``;
  409: read and apply again), so replicas writing at once lose none of each other's stops. A ConfigMap left
  with no stops stays, with an empty list. Each call has the adapter's timeout and retries (429, 5xx,
  connection errors). Each entry is read on its own, keys this release does not know ignored and kept: a
  replica of another release may add some, and an entry that is no stop this release reads is logged and
  written back as it was. A ``stops.json`` that is no JSON list at all is not written over (logged, tried
  again): an operator must mend or delete it.
- A site removed from the federation (:meth:`ClusterStops.forget`) leaves the ConfigMap with an empty list, so
  a new site of its name takes up none of its stops.
- A read or write that fails (RBAC without ``configmaps`` in that namespace, a missing namespace) is logged as
  an error naming the namespace, the ConfigMap and the rule needed, and the adapter goes on with its file: a
  site must come up. A failed write is tried again after ``retry_s`` (30 s), doubling to ten minutes, or as
  soon as another change comes; ``close`` makes one last try at what is still queued.

RBAC, in ``state_namespace``: get, create and patch on configmaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes.aio import client as k8s
from pydantic import ValidationError

from adapters.base import AdapterError
from adapters.site_state import KeptStop

log = logging.getLogger(__name__)

PREFIX = "heliotrope-stops-"
DATA_KEY = "stops.json"
RETRY_S = 30.0  # after a write fails, the wait before the next; doubling, at most MAX_RETRY_S
MAX_RETRY_S = 600.0
CONFLICTS = 8  # writes refused in a row because another replica wrote in between, before giving up for now

Key = tuple[str, int]


class Unreadable(ValueError):
    """The ConfigMap's ``stops.json`` is no JSON list: what wrote it is unknown, so it is not written over."""


def config_map_name(site: str, prefix: str = PREFIX) -> str:
    """``heliotrope-stops-<site>`` (or ``prefix`` + site): a DNS-1123 name of at most 63 characters; a site name
    that would not give one as it is (too long, or characters a name may not have) keeps its first characters
    and ends in ``-`` and 8 hex digits of its SHA-256."""
    slug = re.sub(r"[^a-z0-9-]", "-", site.lower()).strip("-")
    if slug == site and len(prefix + slug) <= 63:
        return prefix + slug
    digest = hashlib.sha256(site.encode()).hexdigest()[:8]
    kept = slug[:63 - len(prefix) - 9].strip("-")
    return f"{prefix}{kept}-{digest}" if kept else f"{prefix}{digest}"


class ClusterStops:
    """The ConfigMap of one site's stops. ``call`` is the adapter's ``_json`` (its timeout and retries, JSON
    answers, ``k8s.ApiException`` for an error status); ``core`` gives its ``CoreV1Api``."""

    def __init__(self, site: str, namespace: str, call: Callable[..., Awaitable[Any]],
                 core: Callable[[], k8s.CoreV1Api], close_timeout_s: float = 10.0) -> None:
        self.site = site
        self.namespace = namespace
        self.name = config_map_name(site)
        self._call = call
        self._core = core
        self.close_timeout_s = close_timeout_s
        self.retry_s = RETRY_S
        self._pending: dict[Key, KeptStop | None] = {}  # changes not yet written: the stop, or None (removed)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._forgotten = False  # the site left the federation: nothing more is written
        self.failing: str | None = None  # why the last write failed, until one succeeds
        self._unread: set[str] = set()  # entries of the ConfigMap that are no stop this release reads, logged

    @property
    def where(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    def _rbac(self) -> str:
        return (f"the adapter's service account needs get, create and patch on configmaps in namespace "
                f"{self.namespace} (a Role bound there), and the namespace must exist")

    # --- reading ---

    async def _get(self) -> dict[str, Any] | None:
        try:
            read = self._core().read_namespaced_config_map_without_preload_content
            return await self._call(f"reading {self.where}", read, self.name, self.namespace)
        except k8s.ApiException as e:
            if e.status == 404:
                return None
            raise

    def _parse(self, cm: dict[str, Any] | None) -> tuple[dict[Key, KeptStop], dict[Key, Any], list[Any]]:
        """The stops ``cm`` holds (none where there is no ConfigMap or no list in it), each entry as it was
        written, by stop, and the entries that are no stop this release reads. Each entry is read on its own,
        and keys this release does not know are ignored: a replica of another release (a rolling upgrade) may
        write more, and one entry it cannot read must not cost the others. A ``stops.json`` that is no JSON
        list raises :class:`Unreadable`: it is not written over."""
        data = ((cm or {}).get("data") or {}).get(DATA_KEY)
        if not data:
            return {}, {}, []
        try:
            entries = json.loads(data)
        except ValueError as e:
            raise Unreadable(f"{self.where} holds no JSON under {DATA_KEY} ({e})") from None
        if not isinstance(entries, list):
            raise Unreadable(f"{self.where} holds no JSON list under {DATA_KEY}")
        stops: dict[Key, KeptStop] = {}
        raw: dict[Key, Any] = {}
        other: list[Any] = []
        for entry in entries:
            try:
                if not isinstance(entry, dict):
                    raise ValueError("not an object")
                stop = KeptStop.model_validate({k: v for k, v in entry.items() if k in KeptStop.model_fields})
            except (ValidationError, ValueError) as e:
                seen = json.dumps(entry, sort_keys=True)
                if seen not in self._unread:  # once each, not at every write
                    self._unread.add(seen)
                    log.error("site %s: %s holds an entry that is no stop this release reads (%s); it is kept as "
                              "it is", self.site, self.where, str(e).splitlines()[0])
                other.append(entry)
                continue
            stops[(stop.job_id, stop.attempt)] = stop
            raw[(stop.job_id, stop.attempt)] = entry
        return stops, raw, other

    async def read(self) -> list[KeptStop] | None:
        """The stops kept in the cluster (none when there is no ConfigMap yet); None when it cannot be read
        (logged as an error: the adapter goes on with its file)."""
        try:
            cm = await self._get()
            stops = self._parse(cm)[0]
        except (k8s.ApiException, AdapterError, ValueError) as e:  # (ValueError: Unreadable, or an answer no JSON)
            why = f"{e.status}: {e.reason}" if isinstance(e, k8s.ApiException) else str(e)
            log.error("site %s: cannot read the stops not yet reported from %s (%s); going on with those of the "
                      "adapter's state_dir only, so a stop begun by a broker replica with another state folder "
                      "whose Pods have gone is taken for a lost attempt. %s", self.site, self.where,
                      _short(why), self._rbac())
            return None
        return sorted(stops.values(), key=lambda s: (s.job_id, s.attempt))

    # --- writing ---

    def put(self, key: Key, stop: KeptStop | None) -> None:
        """Queue a change (``StopJournal.listener``): ``stop`` added or replaced, or None: removed. Ignored once
        forgotten."""
        if self._forgotten:
            return
        self._pending[key] = stop
        self._wake.set()

    def start(self) -> None:
        if self._task is None and not self._forgotten:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"k8s-{self.site}-stops")

    async def close(self) -> None:
        """Write what is queued (one more try, at most ``close_timeout_s``), then stop the writer."""
        self._closing = True
        self._wake.set()
        if self._task is None:
            return
        task, self._task = self._task, None
        if not await _finish(task, self.close_timeout_s):
            log.error("site %s: the stops not yet reported could not be written to %s before the adapter closed; "
                      "they are kept in its state_dir only", self.site, self.where)

    async def forget(self) -> None:
        """The site leaves the federation: drop the changes still queued, stop the writer (a write under way
        lands first), and leave the ConfigMap with an empty list (a merge patch: the ConfigMap stays, and so do the
        rights it needs), so a new site of its name takes up none of these stops as its own. A failure is logged:
        the new site would report them."""
        self._forgotten = True
        self._pending.clear()
        await self.close()
        try:
            update = self._core().patch_namespaced_config_map_without_preload_content
            await self._call(f"updating {self.where}", update, self.name, self.namespace, {"data": {DATA_KEY: "[]"}},
                             _content_type="application/merge-patch+json")
        except k8s.ApiException as e:
            if e.status != 404:  # (none: nothing to take up)
                log.error("site %s: cannot take the stops not yet reported out of %s (%s: %s); a new site of its "
                          "name would report them as its own: delete the ConfigMap", self.site, self.where, e.status,
                          _short(str(e.reason)))
        except Exception as e:  # noqa: BLE001 - the site is removed all the same; logged
            log.error("site %s: cannot take the stops not yet reported out of %s (%s); a new site of its name "
                      "would report them as its own: delete the ConfigMap", self.site, self.where,
                      _short(str(e) if isinstance(e, AdapterError) else repr(e)))

    async def _run(self) -> None:
        wait = 0.0
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            ops = dict(self._pending)
            self._wake.clear()
            try:
                await self._write(ops)
            except Exception as e:  # noqa: BLE001 - the writer must outlive any failure; logged, tried again
                why = _short(f"{e.status}: {e.reason}" if isinstance(e, k8s.ApiException)
                             else str(e) if isinstance(e, (AdapterError, Unreadable)) else repr(e))
                (log.error if why != self.failing else log.debug)(
                    "site %s: cannot write the stops not yet reported to %s (%s); they are kept in the adapter's "
                    "state_dir only, so a broker replica with another state folder that takes over would take "
                    "their attempts for lost. %s. Tried again in %.0f s, or at the next stop", self.site,
                    self.where, why, self._rbac(), min(max(2 * wait, self.retry_s), MAX_RETRY_S))
                self.failing = why
                if self._closing:
                    return
                wait = min(max(2 * wait, self.retry_s), MAX_RETRY_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue
            for key, stop in ops.items():
                if key in self._pending and self._pending[key] is stop:
                    del self._pending[key]
            if self.failing is not None:
                log.info("site %s: the stops not yet reported are written to %s again", self.site, self.where)
            self.failing, wait = None, 0.0

    async def _write(self, ops: dict[Key, KeptStop | None]) -> None:
        """Apply ``ops`` to the ConfigMap's list: create it (409: someone did meanwhile), or patch it on
        condition of the ``resourceVersion`` read (409: someone wrote meanwhile); either way read again."""
        core = self._core()
        for _ in range(CONFLICTS):
            cm = await self._get()
            stops, raw, other = self._parse(cm)  # Unreadable: not written over (logged, tried again)
            before = dict(stops)
            for key, stop in ops.items():
                if stop is None:
                    stops.pop(key, None)
                else:
                    stops[key] = stop
            # Each stop as it was written where it is unchanged (with what another release added to it), then
            # the entries no stop of this release.
            entries = [raw[key] if key in raw and before.get(key) is stop else stop.model_dump(mode="json")
                       for key, stop in sorted(stops.items())] + other
            data = {DATA_KEY: json.dumps(entries, indent=1)}
            try:
                if cm is None:
                    manifest = {"apiVersion": "v1", "kind": "ConfigMap",
                                "metadata": {"name": self.name, "namespace": self.namespace,
                                             "labels": {"app.kubernetes.io/part-of": "heliotrope",
                                                        "heliotrope.io/site": self.site}},
                                "data": data}
                    create = core.create_namespaced_config_map_without_preload_content
                    await self._call(f"creating {self.where}", create, self.namespace, manifest)
                elif stops != before:
                    version = (cm.get("metadata") or {}).get("resourceVersion")
                    patch: dict[str, Any] = {"data": data}
                    if version:  # the write takes only if the ConfigMap is still the one read
                        patch["metadata"] = {"resourceVersion": version}
                    update = core.patch_namespaced_config_map_without_preload_content
                    await self._call(f"updating {self.where}", update, self.name, self.namespace, patch,
                                     _content_type="application/merge-patch+json")
                return
            except k8s.ApiException as e:
                if e.status != 409:
                    raise
                log.debug("site %s: %s was written by another process meanwhile; applying the changes again",
                          self.site, self.where)
        raise AdapterError(f"{self.where} was changed by another process at each of {CONFLICTS} writes")


async def _finish(task: asyncio.Task[None], timeout_s: float) -> bool:
    """Let a writer ``task`` finish what is queued, at most ``timeout_s``, then stop it; whether it finished."""
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout_s)
        return True
    except TimeoutError:
        return False
    except Exception:  # noqa: BLE001 - (a writer logs its own failures; close goes on)
        return True
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def _short(why: str) -> str:
    return why.replace("\n", " ")[:300]


USAGE_PREFIX = "heliotrope-usage-"
USAGE_KEY = "usage.json"


class ClusterUsage:
    """The site's usage history (:class:`adapters.site_state.UsageJournal`) kept in the cluster too, in the
    ConfigMap ``heliotrope-usage-<site>`` of ``state_namespace``, key ``usage.json``, the same JSON as the file:
    a broker replica with another state folder that takes over the site reads it at start and takes whichever
    of the two was saved last. Written whole, in the background, the latest save only (one adapter runs a site at
    a time: the leader's); a write that fails is logged once and tried again at the next save. A site removed
    from the federation (:meth:`forget`) takes its history out of the ConfigMap, so a new site of its name starts
    afresh. Same RBAC as :class:`ClusterStops`."""

    def __init__(self, site: str, namespace: str, call: Callable[..., Awaitable[Any]],
                 core: Callable[[], k8s.CoreV1Api], close_timeout_s: float = 10.0) -> None:
        self.site, self.namespace = site, namespace
        self.name = config_map_name(site, USAGE_PREFIX)
        self._call, self._core = call, core
        self.close_timeout_s = close_timeout_s
        self._latest: bytes | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._exists: bool | None = None
        self._closing = False
        self._forgotten = False
        self.failing: str | None = None

    @property
    def where(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    async def read(self) -> bytes | None:
        """The history kept in the cluster, as written (None: none yet, or unreadable: logged)."""
        try:
            read = self._core().read_namespaced_config_map_without_preload_content
            cm = await self._call(f"reading {self.where}", read, self.name, self.namespace)
        except k8s.ApiException as e:
            if e.status == 404:
                self._exists = False
                return None
            log.error("site %s: cannot read the usage history from %s (%s: %s); going on with the state_dir's",
                      self.site, self.where, e.status, _short(str(e.reason)))
            return None
        except (AdapterError, ValueError) as e:  # (ValueError: an answer that is no JSON)
            log.error("site %s: cannot read the usage history from %s (%s); going on with the state_dir's",
                      self.site, self.where, _short(str(e)))
            return None
        self._exists = True
        data = ((cm or {}).get("data") or {}).get(USAGE_KEY)
        return data.encode() if data else None

    def put(self, data: bytes) -> None:
        """Queue ``data`` (a save of the history) for the ConfigMap: only the latest queued is written. Ignored
        once closed or forgotten."""
        if self._closing or self._forgotten:
            return
        self._latest = data
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"k8s-{self.site}-usage")

    async def close(self) -> None:
        """Let the writer finish what is queued (at most ``close_timeout_s``), then stop it."""
        self._closing = True
        if self._task is None:
            return
        self._wake.set()
        task, self._task = self._task, None
        if not await _finish(task, self.close_timeout_s):
            log.error("site %s: the usage history could not be written to %s before the adapter closed; it is kept "
                      "in its state_dir only", self.site, self.where)

    async def forget(self) -> None:
        """The site leaves the federation: write nothing more (what is in flight lands first), and take the
        history out of the ConfigMap (a merge patch: ``patch`` alone, the ConfigMap stays), so a new site of its
        name starts afresh. A failure is logged: the new site would take the old history."""
        self._forgotten = True
        self._latest = None
        await self.close()
        if self._exists is False:
            return
        try:
            await self._call(f"updating {self.where}", self._core().patch_namespaced_config_map_without_preload_content,
                             self.name, self.namespace, {"data": {USAGE_KEY: None}},
                             _content_type="application/merge-patch+json")
        except k8s.ApiException as e:
            if e.status != 404:
                log.error("site %s: cannot take the usage history out of %s (%s: %s); a new site of its name would "
                          "start from it: delete the ConfigMap", self.site, self.where, e.status, _short(str(e.reason)))
        except Exception as e:  # noqa: BLE001 - the site is removed all the same; logged
            log.error("site %s: cannot take the usage history out of %s (%s); a new site of its name would start "
                      "from it: delete the ConfigMap", self.site, self.where,
                      _short(str(e) if isinstance(e, AdapterError) else repr(e)))

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._write_latest()
            if self._closing and self._latest is None:
                return

    async def _write_latest(self) -> None:
        data, self._latest = self._latest, None
        if data is None:
            return
        body = {"data": {USAGE_KEY: data.decode()}}
        try:
            core = self._core()
            patch = core.patch_namespaced_config_map_without_preload_content
            if self._exists is not False:  # (written over: none yet, found at start or by the last write, is made)
                try:
                    await self._call(f"updating {self.where}", patch, self.name, self.namespace, body,
                                     _content_type="application/merge-patch+json")
                except k8s.ApiException as e:
                    if e.status != 404:
                        raise
                    self._exists = False
            if self._exists is False:
                manifest = {"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": self.name, "namespace": self.namespace,
                                         "labels": {"app.kubernetes.io/part-of": "heliotrope",
                                                    "heliotrope.io/site": self.site}}, **body}
                try:
                    await self._call(f"creating {self.where}",
                                     core.create_namespaced_config_map_without_preload_content, self.namespace, manifest)
                except k8s.ApiException as e:
                    if e.status != 409:
                        raise
                    await self._call(f"updating {self.where}", patch, self.name, self.namespace, body,
                                     _content_type="application/merge-patch+json")  # made meanwhile
            self._exists = True
        except Exception as e:  # noqa: BLE001 - the writer must outlive any failure (later saves go on); logged
            why = _short(f"{e.status}: {e.reason}" if isinstance(e, k8s.ApiException)
                         else str(e) if isinstance(e, AdapterError) else repr(e))
            (log.error if why != self.failing else log.debug)(
                "site %s: cannot write the usage history to %s (%s); it is kept in the adapter's state_dir only, so "
                "a broker replica with another state folder that takes over starts the fair share's window afresh; "
                "the adapter's service account needs get, create and patch on configmaps in namespace %s. Tried "
                "again at the next save", self.site, self.where, why, self.namespace)
            self.failing = why
            return
        if self.failing is not None:
            log.info("site %s: the usage history is written to %s again", self.site, self.where)
        self.failing = None
