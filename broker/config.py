"""Federation configuration from YAML, validated by pydantic.

A file holds the broker's settings and the sites it starts with::

    broker: {host: 127.0.0.1, port: 8080, db: var/heliotrope.db}
    sites:
      - name: berlin
        region: gcp:europe-west3
        ...

An error names the file, the field and the problem, for example
``config/demo.yaml: sites[2].gpus[0].model: unknown GPU model 'a1000'; known models: ...``.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.errors import problems
from broker.models import SiteSpec


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message says where and why."""


from policies.profiles import ProfilesConfig  # noqa: E402 - after the imports above, for readability


class BrokerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    db: str = "var/heliotrope.db"
    cycle_interval_s: float = Field(
        default=1.0, gt=0, description="longest wait between scheduling cycles, and between full passes"
    )
    min_cycle_gap_s: float = Field(default=0.05, ge=0, description="shortest wait between scheduling cycles")
    collect_timeout_s: float = Field(default=2.0, gt=0, description="how long a site may take to report")
    site_stale_after_s: float = Field(default=15.0, gt=0, description="a site silent this long is unhealthy")
    dispatch_timeout_s: float = Field(default=30.0, gt=0, description="how long a site may take to admit")
    refusal_ttl_s: float = Field(default=30.0, ge=0, description="a site that refused a job is skipped this long")
    shutdown_grace_s: float = Field(default=5.0, ge=0, description="how long shutdown waits for dispatches")
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    profiles: ProfilesConfig = Field(default_factory=ProfilesConfig,
                                     description="routing profiles: the default, and which ones a job may choose")


class FederationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    sites: list[SiteSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_sites(self) -> FederationConfig:
        names = [s.name for s in self.sites]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"site names must be unique; repeated: {', '.join(dupes)}")
        return self


def load_config(path: str | Path) -> FederationConfig:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping with 'broker' and 'sites'")
    try:
        return FederationConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"{p}: {d['field']}: {d['problem']}" for d in problems(e)]
        raise ConfigError("\n".join(lines)) from None
