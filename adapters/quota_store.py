"""A site operator's run-time quota changes, kept so the site has them again after a restart.

The site's configuration (``SiteSpec.quotas``) is the starting point; each change the operator makes through
the API (``PUT`` or ``DELETE /v1/sites/{name}/quota/{tenant}``) is an override of one tenant: its new quota,
or its removal. Overrides are kept in one JSON file per site, written atomically (a temporary file in the
same folder, flushed, then renamed over the old one), so a crash leaves the old or the new file, never half
of one; a file that cannot be read at start (edited by hand, a disk error) is moved aside with a logged
error, and the site starts from its configured quotas. Without a path the overrides live in memory only (tests, and sites whose broker keeps no files).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from adapters.base import AdapterError
from broker.models import TenantQuota

log = logging.getLogger(__name__)

_FILE = TypeAdapter(dict[str, TenantQuota | None])


class QuotaStoreError(AdapterError):
    """The overrides file cannot be written; the message names the file and what is wrong. (The API answers
    503: the site could not take the change, and nothing changed.)"""


class QuotaOverrides:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._overrides: dict[str, TenantQuota | None] = self._load()

    def _load(self) -> dict[str, TenantQuota | None]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            return _FILE.validate_json(self.path.read_bytes())
        except (OSError, ValidationError, ValueError) as e:
            # The site must come up: it keeps the damaged file aside for its operator and starts from its
            # configured quotas, saying so loudly.
            aside = self.path.with_suffix(".json.unreadable")
            log.error("cannot read the quota overrides in %s (%s); moved to %s, starting from the configured "
                      "quotas", self.path, e, aside)
            try:
                os.replace(self.path, aside)
            except OSError as err:
                log.error("could not move %s aside: %s", self.path, err)
            return {}

    def apply(self, configured: Sequence[TenantQuota]) -> list[TenantQuota]:
        """The quotas in force: the configured ones, with the overrides applied, in tenant order."""
        quotas = {q.tenant: q for q in configured}
        for tenant, quota in self._overrides.items():
            if quota is None:
                quotas.pop(tenant, None)
            else:
                quotas[tenant] = quota
        return [quotas[t] for t in sorted(quotas)]

    def set(self, quota: TenantQuota) -> None:
        self._save({**self._overrides, quota.tenant: quota})

    def remove(self, tenant: str) -> None:
        self._save({**self._overrides, tenant: None})

    def forget(self) -> None:
        """Drop every override, and the file that kept them."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self._overrides = {}

    def _save(self, overrides: dict[str, TenantQuota | None]) -> None:
        if self.path is not None:
            data = json.dumps({t: (q.model_dump(mode="json") if q is not None else None)
                               for t, q in sorted(overrides.items())}, indent=1).encode()
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".quota-", dir=self.path.parent)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
            except OSError as e:
                raise QuotaStoreError(f"cannot write the quota overrides to {self.path}: {e}") from None
        self._overrides = overrides  # only once it is on disk: a failed write changes nothing
