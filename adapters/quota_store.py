"""A site operator's run-time quota changes, kept so the site has them again after a restart.

The site's configuration (``SiteSpec.quotas``) is the starting point; each change the operator makes through
the API (``PUT`` or ``DELETE /v1/sites/{name}/quota/{tenant}``) is an override of one tenant: its new quota,
or its removal. Overrides are kept in one JSON file per site, written atomically (a temporary file in the
same folder, flushed, then renamed over the old one), so a crash leaves the old or the new file, never half
of one; a file that cannot be read at start (edited by hand, a disk error) is moved aside with a logged
error, and the site starts from its configured quotas. A file whose entry names another tenant than the
quota it holds (``{"vision": {"tenant": "nlp", ...}}``, a copied entry whose key was not changed) is such a
file: which tenant was meant cannot be told. Without a path the overrides live in memory only (tests, and sites whose broker keeps no files).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, TypeAdapter

from adapters.base import AdapterError
from adapters.site_state import read_or_set_aside, write_atomically
from broker.models import TenantQuota
from policies.quota import QuotaBook

log = logging.getLogger(__name__)


def log_beyond_site(site: str, book: QuotaBook) -> None:
    """Log each quota of ``book`` that asks for GPUs the site does not have (``QuotaBook.beyond_site``):
    after a site's book is built from its quotas, and after a change reaches it."""
    for text in book.beyond_site():
        log.warning("site %s: %s", site, text)

def _keys_name_their_tenants(overrides: dict[str, TenantQuota | None]) -> dict[str, TenantQuota | None]:
    for key, quota in overrides.items():
        if quota is not None and quota.tenant != key:
            raise ValueError(f"entry {key!r} holds a quota for tenant {quota.tenant!r}; each entry's key must be "
                             f"the tenant of its quota")
    return overrides


_FILE = TypeAdapter(Annotated[dict[str, TenantQuota | None], AfterValidator(_keys_name_their_tenants)])


class QuotaStoreError(AdapterError):
    """The overrides file cannot be written; the message names the file and what is wrong. (The API answers
    503: the site could not take the change, and nothing changed.)"""


class QuotaOverrides:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._overrides: dict[str, TenantQuota | None] = self._load()

    def _load(self) -> dict[str, TenantQuota | None]:
        # The site must come up: a damaged file is kept aside for its operator, and the site starts from its
        # configured quotas, saying so loudly.
        return read_or_set_aside(self.path, _FILE, "the quota overrides", "starting from the configured quotas") or {}

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
                write_atomically(self.path, data)
            except OSError as e:
                raise QuotaStoreError(f"cannot write the quota overrides to {self.path}: {e}") from None
        self._overrides = overrides  # only once it is on disk: a failed write changes nothing
