"""Bearer tokens and roles: who may call which part of the API.

A token is 32 random bytes (``hlt_`` + URL-safe base64). The broker never keeps one: the store holds its
SHA-256 digest (``tokens`` table), so checking a request costs one hash and one dictionary lookup, a few
microseconds. ``heliotrope token create|list|revoke`` writes the table directly (no server needed, so the
first admin token can be made before anyone can call the API); the broker rereads it every
``broker.auth.refresh_s`` (2 s), so a new or revoked token takes effect within that on every replica.

Roles:

- ``admin`` (platform admin): everything.
- ``operator`` (site operator), scoped to named sites: read every site's public view, change its own sites'
  spec and quotas, read their quota state, health and metrics, see the jobs on them and their events.
- ``submitter``, scoped to named tenants: submit, read and cancel jobs of those tenants, follow their events,
  read the sites' public view and its own tenants' quota state. Another tenant's job is answered 404, as if
  it did not exist.

Nobody, admin included, is ever sent a site's secrets (``SECRET_FIELDS``: the kubeconfig of a Kubernetes
site); a site update that leaves a secret out keeps the stored one.

Turn it on with ``broker.auth.enabled: true``. Off, every request acts as an anonymous admin, which
``broker.server`` allows on a loopback address only.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.config import AuthSettings
from broker.models import Job, Slug, UtcDatetime

log = logging.getLogger(__name__)

TOKEN_PREFIX = "hlt_"


class Role(enum.StrEnum):
    ADMIN = "admin"
    OPERATOR = "operator"
    SUBMITTER = "submitter"


class TokenRecord(BaseModel):
    """What the store keeps of a token: never the token, only its digest."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="public handle, for listing and revoking")
    name: str = Field(min_length=1, max_length=100, description="who or what holds it")
    role: Role
    sites: list[Slug] = Field(default_factory=list, description="operator: the sites it may change")
    tenants: list[Slug] = Field(default_factory=list, description="submitter: the tenants it acts for")
    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the token, hex")
    created_at: UtcDatetime
    expires_at: UtcDatetime | None = None
    revoked_at: UtcDatetime | None = None

    @model_validator(mode="after")
    def _scoped(self) -> TokenRecord:
        if self.role == Role.OPERATOR and not self.sites:
            raise ValueError("an operator token names at least one site (--site)")
        if self.role == Role.SUBMITTER and not self.tenants:
            raise ValueError("a submitter token names at least one tenant (--tenant)")
        if self.role == Role.ADMIN and (self.sites or self.tenants):
            raise ValueError("an admin token is not scoped: leave out --site and --tenant")
        if self.role == Role.OPERATOR and self.tenants:
            raise ValueError("an operator token is scoped to sites, not tenants: leave out --tenant")
        if self.role == Role.SUBMITTER and self.sites:
            raise ValueError("a submitter token is scoped to tenants, not sites: leave out --site")
        return self

    def public(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"digest"})


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def new_token() -> tuple[str, str]:
    """A fresh token and its public id."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32), "tok-" + secrets.token_hex(6)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a token's role and scope."""

    name: str
    role: Role
    sites: frozenset[str] = field(default_factory=frozenset)
    tenants: frozenset[str] = field(default_factory=frozenset)
    token_id: str | None = None

    @property
    def admin(self) -> bool:
        return self.role == Role.ADMIN

    def operates(self, site: str | None) -> bool:
        """May change this site (its spec, its quotas) and see its jobs."""
        return self.admin or (self.role == Role.OPERATOR and site is not None and site in self.sites)

    def acts_for(self, tenant: str) -> bool:
        """May submit, read and cancel this tenant's jobs."""
        return self.admin or (self.role == Role.SUBMITTER and tenant in self.tenants)

    def sees_job(self, job: Job) -> bool:
        return self.acts_for(job.spec.tenant) or self.operates(job.site)

    def sees_event(self, tenant: str | None, site: str | None) -> bool:
        """An event about a job of ``tenant`` at ``site``, or about ``site`` itself (``tenant`` None)."""
        if self.admin:
            return True
        if self.role == Role.SUBMITTER:
            return tenant is not None and tenant in self.tenants
        return site is not None and site in self.sites


ANONYMOUS_ADMIN = Principal("anonymous", Role.ADMIN)
"""Every caller while authentication is off."""


class TokensUnavailable(Exception):
    """The tokens could not be read at all (the store is down at start): 503, not 401."""


class Unauthenticated(Exception):
    """No token, or one the broker does not accept; the message says which (never echoes the token)."""


class TokenBook:
    """The accepted tokens by digest, reread from the store at most every ``refresh_s``."""

    def __init__(self, store: Any, settings: AuthSettings, clock: Any) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self._by_digest: dict[str, TokenRecord] = {}
        self._by_id: dict[str, TokenRecord] = {}
        self._loaded_at = -1e18
        self._lock = asyncio.Lock()
        self._admin_digest: str | None = None
        if settings.admin_token_env:
            value = (os.environ.get(settings.admin_token_env) or "").strip()  # a secret file's newline
            if value:
                self._admin_digest = digest(value)

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    async def refresh(self, force: bool = False) -> None:
        """Reread the tokens if ``refresh_s`` has passed. If the store cannot be read, the last set read
        stands until the next try (``refresh_s`` later); with none read yet, :class:`TokensUnavailable`."""
        if not force and time.monotonic() - self._loaded_at < self.settings.refresh_s:
            return
        async with self._lock:
            if not force and time.monotonic() - self._loaded_at < self.settings.refresh_s:
                return  # another request reloaded while this one waited
            try:
                docs = await self.store.list_tokens()
            except Exception as e:
                if self._loaded_at < 0:
                    raise TokensUnavailable(f"the broker cannot read its tokens from the store ({e}); try again "
                                            "in a few seconds") from None
                log.warning("cannot reread the tokens (%s); the %d read before stand for %.1f s more", e,
                            len(self._by_digest), self.settings.refresh_s)
                self._loaded_at = time.monotonic()
                return
            by_digest: dict[str, TokenRecord] = {}
            for doc in docs:
                try:
                    record = TokenRecord.model_validate_json(doc)
                except ValueError as e:  # written by another version, or by hand: that token alone is refused
                    log.warning("a stored token record cannot be read and is refused: %s", str(e).splitlines()[0])
                    continue
                if record.revoked_at is None:
                    by_digest[record.digest] = record
            self._by_digest = by_digest
            self._by_id = {r.id: r for r in by_digest.values()}
            self._loaded_at = time.monotonic()

    async def still_valid(self, who: Principal) -> bool:
        """Whether ``who``'s token is still accepted (a stream re-checks it as it goes)."""
        if not self.enabled or who.token_id is None:
            return True  # auth off, or the environment's admin token
        await self.refresh()
        record = self._by_id.get(who.token_id)
        return record is not None and (record.expires_at is None or record.expires_at > self.clock.now())

    async def authenticate(self, header: str | None) -> Principal:
        """The principal for an ``Authorization`` header; :class:`Unauthenticated` if there is none."""
        if not self.enabled:
            return ANONYMOUS_ADMIN
        if not header:
            raise Unauthenticated("this broker requires a bearer token: send 'Authorization: Bearer TOKEN' "
                                  "(make one with 'heliotrope token create')")
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("the Authorization header must be 'Bearer TOKEN'")
        d = digest(token)
        if self._admin_digest is not None and secrets.compare_digest(d, self._admin_digest):
            return Principal(f"${self.settings.admin_token_env}", Role.ADMIN)
        await self.refresh()
        record = self._by_digest.get(d)
        if record is None:
            raise Unauthenticated("the token is unknown or revoked")
        if record.expires_at is not None and record.expires_at <= self.clock.now():
            raise Unauthenticated(f"token {record.id} ({record.name}) expired at {record.expires_at.isoformat()}")
        return Principal(record.name, record.role, frozenset(record.sites), frozenset(record.tenants), record.id)


def make_record(name: str, role: Role | str, sites: Iterable[str], tenants: Iterable[str], now: datetime,
                expires_at: datetime | None = None) -> tuple[str, TokenRecord]:
    """A new token and the record to store for it (``ValueError`` for a scope the role does not take)."""
    token, token_id = new_token()
    record = TokenRecord(id=token_id, name=name, role=Role(role), sites=sorted(set(sites)),
                         tenants=sorted(set(tenants)), digest=digest(token), created_at=now, expires_at=expires_at)
    return token, record


# --- secrets in site specs ---

SECRET_FIELDS: dict[str, tuple[str, ...]] = {"kubernetes": ("kubeconfig",)}
"""Adapter fields the API never returns, by adapter kind: write-only. A ``PUT`` that leaves one out keeps
the stored value (the spec as read back can be sent back unchanged)."""


CREDENTIAL_FIELDS: dict[str, tuple[str, ...]] = {
    "simulated": ("state_dir",),
    "kubernetes": ("kubeconfig", "in_cluster", "context", "host", "state_dir", "namespace_prefix", "state_namespace",
                   "telemetry"),
    "mqtt": (),
}
"""Adapter fields that select credentials or where the broker writes, by adapter kind: only a platform admin
may change them (or the kind itself). A site operator may change the rest of its own site's adapter settings
(timeouts, retries, the job image, a simulated site's delays). ``namespace_prefix`` picks the namespaces the
broker's credentials write Jobs and ResourceQuotas into: sites sharing a cluster are told apart by it, so an
operator who could set it to another site's prefix would overwrite or delete that site's quotas there.
``state_namespace`` picks the namespace the broker's credentials write a ConfigMap into.
``telemetry`` names an environment variable of the broker's (``token_env``) whose value is sent as a bearer
token to its ``url``: an operator who could set both could have any of the broker's secrets sent to a server
of theirs."""


def credential_changes(old: Any, new: Any) -> list[str]:
    """The adapter fields (of an ``AdapterConfig``) that differ between ``old`` and ``new`` and only an admin
    may change: ``["kind"]`` when the kind changes, else the changed :data:`CREDENTIAL_FIELDS`."""
    if old.kind != new.kind:
        return ["kind"]
    return [f for f in CREDENTIAL_FIELDS.get(new.kind, ()) if getattr(old, f) != getattr(new, f)]


def redact_site(doc: dict[str, Any]) -> dict[str, Any]:
    """A site spec as JSON, without its secrets."""
    adapter = doc.get("adapter")
    if isinstance(adapter, dict):
        hidden = SECRET_FIELDS.get(str(adapter.get("kind")), ())
        if hidden:
            doc = {**doc, "adapter": {k: v for k, v in adapter.items() if k not in hidden}}
    return doc


def keep_secrets(new: Any, old: Any) -> Any:
    """``new`` (a SiteSpec) with the secrets it leaves out taken from ``old`` (the stored spec), when both
    run the same kind of adapter."""
    hidden = SECRET_FIELDS.get(new.adapter.kind, ())
    if not hidden or old is None or old.adapter.kind != new.adapter.kind:
        return new
    kept = {f: getattr(old.adapter, f) for f in hidden if f not in new.adapter.model_fields_set}
    if not kept:
        return new
    return new.model_copy(update={"adapter": new.adapter.model_copy(update=kept)})
