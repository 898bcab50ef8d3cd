"""Federation configuration from YAML, validated by pydantic.

A file holds the broker's settings and the sites it starts with::

    broker: {host: 127.0.0.1, port: 8080, db: var/heliotrope.db}
    sites:
      - name: berlin
        region: gcp:europe-west3
        ...

An error names the file, the field and the problem, for example
``config/demo.yaml: sites[2].gpus[0].model: unknown GPU model 'a1000'; known models: ...``.

Environment variables override the file (containers, Kubernetes): ``HELIOTROPE_BROKER__<FIELD>``, with
``__`` between nested fields, each value read as YAML (``HELIOTROPE_BROKER__PORT=9090``,
``HELIOTROPE_BROKER__DB=postgresql://...``, ``HELIOTROPE_BROKER__MQTT__HOST=mosquitto``,
``HELIOTROPE_BROKER__AUTH__ENABLED=true``); a setting that is text takes the variable as written where YAML
would read it as something else (``HELIOTROPE_BROKER__HOST=::``). An error in one names the variable.

Live signals (optional): ``broker.carbon`` names a carbon-intensity provider and ``broker.carbon_forecast``
how each zone is forecast (:mod:`broker.signals`); ``broker.prices`` names a price provider that overrides
the sites' ``usd_per_gpu_hour``. A relative ``path`` in either provider is read relative to the folder of
the configuration file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from broker.errors import at, located, problems
from broker.models import MAX_TENANT_LIMIT_GPUS, MqttSettings, SiteSpec, Slug
from broker.providers.carbon import CarbonProviderConfig, FilesCarbonConfig
from broker.providers.prices import FilesPriceConfig, PriceProviderConfig
from broker.signals import CarbonForecastSettings
from broker.store import check_db


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message says where and why."""


from policies.profiles import ProfilesConfig  # noqa: E402 - after the imports above, for readability
from policies.tenant_limit import TenantLimits  # noqa: E402


HOUR_S = 3600.0
DAY_S = 86_400.0


class ReplicaSettings(BaseModel):
    """Several broker replicas on one shared database (``broker.leadership``): one leads, the rest serve the API."""

    model_config = ConfigDict(extra="forbid")

    lease_s: float = Field(default=6.0, gt=0.5, le=300,
                           description="the leader renews its lease every third of this; a dead leader is "
                                       "replaced within about 4/3 of it")
    advertise_url: str | None = Field(
        default=None, pattern=r"^https?://",
        description="where the other replicas reach this one's API (default: the address it serves on)")


class AuthSettings(BaseModel):
    """Bearer tokens (``broker.auth``): who may call the API. Tokens are made and revoked with
    ``heliotrope token create|list|revoke``, which writes their SHA-256 digests into the broker's database."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=False,
        description="require a bearer token on every API call but /healthz, /openapi.json and the dashboard's "
                    "static page. Off: the API is open, which the broker allows on a loopback address only")
    admin_token_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="an environment variable holding a platform-admin token the broker also accepts (a "
                    "Kubernetes Secret or a compose secret: the first admin before any token is stored)")
    refresh_s: float = Field(
        default=2.0, gt=0, le=300,
        description="how often the broker rereads the stored tokens: a token made or revoked with the CLI "
                    "takes effect within this")


class ServerTlsSettings(BaseModel):
    """HTTPS for the API (``broker.tls``): PEM files, read at start."""

    model_config = ConfigDict(extra="forbid")

    cert_file: str = Field(min_length=1, description="the server's certificate chain (PEM)")
    key_file: str = Field(min_length=1, description="its private key (PEM)")
    client_ca_file: str | None = Field(
        default=None, description="require client certificates signed by this CA (mutual TLS); unset: none asked")
    peer_ca_file: str | None = Field(
        default=None, description="the CA of the other replicas' certificates, trusted when a replica passes a "
                                  "request on to the leader (unset: the system's CA store)")


def is_shared_database(db: str) -> bool:
    """Whether ``db`` names a database several replicas may share (PostgreSQL): then they elect a leader."""
    return db.startswith(("postgresql://", "postgres://"))


class TenantLimit(BaseModel):
    """How many GPUs one tenant's jobs may hold at once across every site of the federation together
    (:mod:`policies.tenant_limit`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    gpus: float = Field(ge=0, le=MAX_TENANT_LIMIT_GPUS, description="GPUs the tenant's jobs on sites (dispatching, "
                        "admitted, running) may hold together, a fractional job counting its share; 0: none start")


class BrokerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # (an .inf interval would stop the loop)

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    db: Annotated[str, AfterValidator(check_db)] = "var/heliotrope.db"
    # Each duration has a ceiling past which it is surely a slip (1e308 parses as a number, and a cycle that far
    # apart never comes): an hour for the waits and timeouts of one cycle or call, a day for how long a site's
    # silence or refusal is borne.
    cycle_interval_s: float = Field(
        default=1.0, gt=0, le=HOUR_S,
        description="longest wait between scheduling cycles, and between full passes (at most 3600)"
    )
    min_cycle_gap_s: float = Field(default=0.05, ge=0, le=HOUR_S,
                                   description="shortest wait between scheduling cycles (at most 3600)")
    collect_timeout_s: float = Field(default=2.0, gt=0, le=HOUR_S,
                                     description="how long a site may take to report (at most 3600)")
    site_stale_after_s: float = Field(default=15.0, gt=0, le=DAY_S,
                                      description="a site silent this long is unhealthy (at most 86400)")
    dispatch_timeout_s: float = Field(default=30.0, gt=0, le=HOUR_S,
                                      description="how long a site may take to admit (at most 3600)")
    refusal_ttl_s: float = Field(default=30.0, ge=0, le=DAY_S,
                                 description="a site that refused a job is skipped this long (at most 86400)")
    max_lost_attempts: int | None = Field(
        default=10, ge=0, le=1000,
        description="lost attempts a job is allowed where its spec does not say (max_lost_attempts): at this many "
                    "losses (its site went away, a drain or eviction, a Pod the cluster could not place, a remote "
                    "site's lease run out) it fails rather than be requeued again; 0 or null: no bound",
    )
    job_retention_h: float | None = Field(
        default=720.0, ge=0, le=1_000_000,  # (a century and more; past about two millennia the cutoff overflows)
        description="finished jobs (succeeded, failed, cancelled) are deleted with their transitions and decision "
                    "this many hours after they ended (720: 30 days; at most 1,000,000); 0 or null: kept for ever")
    tenant_limits: dict[Slug, TenantLimit] = Field(
        default_factory=dict,
        description="per tenant, the GPUs its jobs may hold at once across the whole federation; a job that would "
                    "take its tenant past it waits in the queue (as Armada's queue limits, Kueue's ClusterQueue "
                    "quotas), whatever each site's own quota allows")
    default_tenant_limit: TenantLimit | None = Field(
        default=None, description="the limit of every tenant tenant_limits does not name; none: unlimited")
    shutdown_grace_s: float = Field(default=5.0, ge=0, le=HOUR_S,
                                    description="how long shutdown waits for dispatches (at most 3600)")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30,
                                description="the largest request body the API reads (at most 1 GiB)")
    profiles: ProfilesConfig = Field(default_factory=ProfilesConfig,
                                     description="routing profiles: the default, and which ones a job may choose")
    carbon: CarbonProviderConfig | None = Field(
        default=None,
        description="where live grid carbon intensity comes from: {kind: files, path: DIR} (Electricity Maps CSVs, "
                    "broker.data.carbon) or {kind: http, url, token_env, timeout_s, cache_ttl_s, retries, ...} (an "
                    "Electricity Maps v3 API service); each site's zone is forecast from it (see carbon_forecast). "
                    "Unset: no carbon data, and the carbon scorer ranks every site alike",
    )
    carbon_forecast: CarbonForecastSettings = Field(
        default_factory=CarbonForecastSettings,
        description="how the carbon intensity of each zone is forecast: refresh_s (3600), history_h (672), "
                    "horizon_h (48), reach_h (168: past horizon_h, the zone's mean day), profile_days (28), model "
                    "(auto | seasonal_naive | holt_winters), season_h, stale_after_s "
                    "(a failing zone keeps its last forecast this long), fetch_timeout_s, replay_day",
    )
    replicas: ReplicaSettings | None = Field(
        default=None,
        description="leader election among replicas sharing the database: {lease_s}. On by default (lease 6 s) "
                    "with a PostgreSQL database, off with SQLite (one broker per file)",
    )
    mqtt: MqttSettings | None = Field(
        default=None,
        description="the MQTT broker that site agents (sites with adapter kind mqtt) reach the broker through: "
                    "{host, port, username, password_env, tls, keepalive_s, reconnect_max_s, client_id}. Unset: "
                    "no remote sites",
    )
    auth: AuthSettings = Field(default_factory=AuthSettings,
                               description="bearer-token authentication and roles: {enabled, admin_token_env, "
                                           "refresh_s}")
    tls: ServerTlsSettings | None = Field(
        default=None, description="serve HTTPS: {cert_file, key_file, client_ca_file}. Unset: plain HTTP")
    prices: PriceProviderConfig | None = Field(
        default=None,
        description="where GPU prices come from: {kind: files, path: CSV} (the GCP price list by each site's "
                    "region, falling back to the site's usd_per_gpu_hour) or {kind: static}. Unset: each site's "
                    "usd_per_gpu_hour",
    )


class FederationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    sites: list[SiteSpec] = Field(default_factory=list)

    @field_validator("broker", "sites", mode="before")
    @classmethod
    def _empty_section(cls, value: Any, info: ValidationInfo) -> Any:
        """A section whose every line is commented out (``broker:`` with nothing under it, null to YAML) is
        its defaults, as an empty file is."""
        if value is None:
            return {} if info.field_name == "broker" else []
        return value

    @model_validator(mode="after")
    def _unique_sites(self) -> FederationConfig:
        names = [s.name for s in self.sites]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise at(("sites", names.index(dupes[0], names.index(dupes[0]) + 1), "name"),
                     f"site names must be unique; repeated: {', '.join(dupes)}")
        for i, site in enumerate(self.sites):
            problems = site.quota_problems()
            if len(problems) == 1:  # (its field, e.g. quotas[1].model, below the site)
                raise at(("sites", i, problems[0]["field"]), problems[0]["problem"])
            if problems:
                raise ValueError("; ".join(f"sites[{i}].{p['field']}: {p['problem']}" for p in problems))
        return self


T = TypeVar("T", bound=BaseModel)


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key written twice in one mapping is an error at its line: the plain loader keeps
    the last and drops the first without a word (a second ``broker:`` at the end of a file threw the first
    away). A key of a merged anchor (``<<: *base``) may still be written again, to override it."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Checked before the merge keys are spliced in (which rewrites node.value in place, and may happen to an
        # anchored mapping before its own construction): its own keys only, once per mapping.
        checked: set[int] = self.__dict__.setdefault("_unique_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                except TypeError:  # (an unhashable key: the safe loader refuses it itself)
                    continue
                if repeated:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} appears twice in the same mapping (YAML would keep only the "
                                    "second); keep one", key_node.start_mark)
                seen.add(key)
        super().flatten_mapping(node)


def yaml_problem(e: yaml.YAMLError) -> str:
    """What is wrong with a YAML text, in one line: ``not valid YAML (line L, column C): PROBLEM``."""
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    return f"not valid YAML{where}: {getattr(e, 'problem', None) or e}"


def is_site_spec(data: Mapping[str, Any], model: type[BaseModel]) -> bool:
    """Whether ``data``, read for ``model``, is one site's spec instead (a file for ``heliotrope sites add``
    given where a config is asked for): a site's name and GPUs, and no key but a site spec's."""
    keys = set(data)
    return {"name", "gpus"} <= keys <= set(SiteSpec.model_fields) and not keys & set(model.model_fields)


def load_yaml_model(path: str | Path, model: type[T], top_level: str, site_spec_given: str | None = None) -> T:
    """A YAML file validated as ``model``. :class:`ConfigError` names the file and, for each problem, the
    field (``top_level`` says what the file's top level must hold when it is not a mapping). A file that is
    one site's spec (:func:`is_site_spec`) is refused with ``site_spec_given``, where given, in one line, rather
    than with each of its keys as an unknown field."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: {yaml_problem(e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping with {top_level}")
    if site_spec_given is not None and is_site_spec(data, model):
        raise ConfigError(f"{p}: {site_spec_given.format(path=p)}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(f"{p}: {located(d)}" for d in problems(e))) from None


# What a site's spec given as the broker's config is told (README, Configuration).
SITE_SPEC_FOR_CONFIG = ("this is one site's spec, not a broker config: a config lists its sites under 'sites:' "
                        "(and its settings under 'broker:', as config/demo.yaml does); register this site with "
                        "'heliotrope sites add {path}'")

ENV_PREFIX = "HELIOTROPE_BROKER__"


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The broker settings that ``HELIOTROPE_BROKER__*`` variables set, as a nested mapping: each name's
    parts after the prefix, split at ``__`` and lower-cased, are the path; its value is read as YAML."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX) or len(name) == len(ENV_PREFIX):
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX):].split("__")]
        if any(not part for part in path):
            raise ConfigError(f"environment variable {name}: empty field name (write HELIOTROPE_BROKER__A__B)")
        try:
            value = yaml.safe_load(environ[name]) if environ[name].strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"environment variable {name}: not a valid YAML value: {getattr(e, 'problem', e)}") from None
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment variable {name}: {'.'.join(path[:-1])} is also set as a whole")
            node = child
        node[path[-1]] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def with_env(config: FederationConfig, environ: Mapping[str, str] | None = None) -> FederationConfig:
    """``config`` with the ``HELIOTROPE_BROKER__*`` overrides applied; :class:`ConfigError` names the
    variable of a value that does not validate."""
    over = env_overrides(environ)
    if not over:
        return config
    data = _merge(config.broker.model_dump(exclude_unset=True), over)
    try:
        try:
            broker = BrokerSettings.model_validate(data)
        except ValidationError as e:
            # A value YAML reads as a number, a date, a boolean or a mapping where the setting is text (``HOST=::``,
            # ``MQTT__HOST=10.0``, ``MQTT__USERNAME=1234``, a file name like ``2024-06-01``) is meant as written:
            # it is taken as the variable's text, and only then is an error reported.
            if not _as_written(data, over, e, os.environ if environ is None else environ):
                raise
            broker = BrokerSettings.model_validate(data)
    except ValidationError as e:
        lines = []
        for d in problems(e):
            var = ENV_PREFIX + d["field"].split("[")[0].replace(".", "__").upper()
            lines.append(f"broker.{d['field']} (environment {var} or the file): {d['problem']}")
        raise ConfigError("\n".join(lines)) from None
    return config.model_copy(update={"broker": broker})


def _as_written(data: dict[str, Any], over: dict[str, Any], error: ValidationError,
                environ: Mapping[str, str]) -> bool:
    """Put back, in ``data``, the variable's own text for each setting that wants a string and got something
    else from a variable that names exactly that setting (``HOST=::`` reads as a mapping); whether any was."""
    changed = False
    for err in error.errors():
        loc = err["loc"]
        if err["type"] != "string_type" or not all(isinstance(part, str) for part in loc):
            continue
        node: Any = over
        for part in loc:
            node = node.get(part) if isinstance(node, dict) else None
        if node is None or isinstance(node, str):
            continue  # the environment did not set it, or set it as text already
        wanted = ENV_PREFIX + "__".join(str(part) for part in loc).upper()
        raw = next((v for k, v in environ.items() if k.upper() == wanted), None)
        if raw is None:
            continue
        target = data
        for part in loc[:-1]:
            target = target[part]
        target[loc[-1]] = raw.strip()
        changed = True
    return changed


def load_config(path: str | Path | None, environ: Mapping[str, str] | None = None) -> FederationConfig:
    """The federation file (``None``: no file, every setting at its default), then the environment's
    ``HELIOTROPE_BROKER__*`` overrides."""
    if path is None:
        return with_env(FederationConfig(), environ)
    config = load_yaml_model(path, FederationConfig, "'broker' and 'sites'", SITE_SPEC_FOR_CONFIG)
    return with_env(_relative_to(config, Path(path).parent), environ)


def _relative_to(config: FederationConfig, folder: Path) -> FederationConfig:
    """The providers' relative ``path`` read relative to the configuration file's folder."""
    b = config.broker
    update: dict[str, object] = {}
    for name in ("carbon", "prices"):
        cfg = getattr(b, name)
        if isinstance(cfg, FilesCarbonConfig | FilesPriceConfig) and not Path(cfg.path).is_absolute():
            update[name] = cfg.model_copy(update={"path": os.path.normpath(folder / cfg.path)})
    if update:
        config.broker = b.model_copy(update=update)
    return config


def tenant_limits(settings: BrokerSettings) -> TenantLimits:
    """The settings' federation-wide tenant limits as the scheduling pass reads them."""
    return TenantLimits({t: lim.gpus for t, lim in settings.tenant_limits.items()},
                        settings.default_tenant_limit.gpus if settings.default_tenant_limit is not None else None)
