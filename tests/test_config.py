"""Loading the federation config: the shipped demo works, and every mistake a platform team can make in a
file is reported with the file name, the field path and what is wrong."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from broker.config import ConfigError, FederationConfig, UniqueKeyLoader, load_config

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "config" / "demo.yaml"


def site_yaml(name: str, model: str = "l4") -> str:
    """One entry of a ``sites:`` list."""
    return (
        f"  - name: {name}\n"
        "    region: gcp:us-east1\n"
        "    grid_zone: US-MIDA-PJM\n"
        "    timezone: America/New_York\n"
        "    latitude: 33.2\n"
        "    longitude: -80.0\n"
        f"    gpus: [{{model: {model}, gpus_per_node: 8, nodes: 1}}]\n"
    )


def write(tmp_path: Path, text: str, name: str = "federation.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- the demo -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo() -> FederationConfig:
    return load_config(DEMO)


def test_the_demo_config_has_at_least_six_sites_in_distinct_grid_zones_and_time_zones(demo: FederationConfig) -> None:
    assert len(demo.sites) >= 6
    assert len({s.grid_zone for s in demo.sites}) == len(demo.sites)
    assert len({s.timezone for s in demo.sites}) == len(demo.sites)


def test_the_demo_config_offers_several_gpu_models_with_prices(demo: FederationConfig) -> None:
    models = {g.model for s in demo.sites for g in s.gpus}
    assert len(models) >= 3
    assert all(s.usd_per_gpu_hour for s in demo.sites), "every demo site prices its GPUs"
    prices = {usd for s in demo.sites for usd in s.usd_per_gpu_hour.values()}
    assert len(prices) >= 3 and all(usd > 0 for usd in prices)


def test_the_demo_config_identifiers_are_canonical(demo: FederationConfig) -> None:
    for s in demo.sites:
        assert s.region.startswith("gcp:")
        assert s.grid_zone == s.grid_zone.upper()
    assert demo.broker.port == 8080


def test_the_demo_config_forecasts_carbon_from_the_shipped_slice(demo: FederationConfig) -> None:
    assert demo.broker.carbon is not None and demo.broker.carbon.kind == "files"
    assert Path(demo.broker.carbon.path) == REPO / "data" / "carbon"
    assert demo.broker.carbon_forecast.replay_day is not None


def test_the_readme_green_profile_copied_into_a_config_is_the_built_in_green(tmp_path: Path) -> None:
    """The README shows ``green`` written out in full under *Configure it per profile*; an operator who starts
    from that block to tune it must not lose what the built-in does unasked (it lacked ``migrate``, so copying
    it stopped every move of running work)."""
    from policies.profiles import ProfilesConfig

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "default: green" in b and "definitions" in b]
    assert len(blocks) == 1
    written = load_config(write(tmp_path, blocks[0])).broker.profiles
    assert "green" in written.definitions
    built_in = ProfilesConfig()
    assert written.weights("green") == built_in.weights("green")
    assert written.shift("green") == built_in.shift("green")
    assert written.migrate("green") == built_in.migrate("green")


def test_provider_paths_are_read_relative_to_the_config_file(tmp_path: Path) -> None:
    path = write(tmp_path, "broker:\n  carbon: {kind: files, path: carbon}\n"
                           "  prices: {kind: files, path: /abs/prices.csv}\n")
    broker = load_config(path).broker
    assert broker.carbon.path == str(tmp_path / "carbon")
    assert broker.prices.path == "/abs/prices.csv"


def test_an_empty_file_is_a_broker_with_default_settings_and_no_sites(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""))
    assert config.sites == []
    assert config.broker.port == 8080


def test_a_section_left_empty_is_its_defaults_as_an_empty_file_is(tmp_path: Path) -> None:
    """Every line of ``broker:`` or of ``sites:`` commented out leaves the key with nothing under it (null to
    YAML), which was refused as 'Input should be a valid dictionary or instance of BrokerSettings'."""
    config = load_config(write(tmp_path, "broker:\n  # port: 9090\nsites:\n" + site_yaml("ashburn")))
    assert config.broker.port == 8080 and [s.name for s in config.sites] == ["ashburn"]
    config = load_config(write(tmp_path, "broker:\n  port: 9090\nsites:\n  # - name: ashburn\n"))
    assert config.broker.port == 9090 and config.sites == []


def test_a_path_may_be_given_as_a_string(tmp_path: Path) -> None:
    path = write(tmp_path, "sites:\n" + site_yaml("ashburn"))
    assert [s.name for s in load_config(str(path)).sites] == ["ashburn"]


# --- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "sites:\n" + site_yaml("ashburn") + site_yaml("berlin", model="a1000"),
            ["sites[1].gpus[0].model", "unknown GPU model 'a1000'", "a100-80gb"],
            id="an unknown GPU model names the site's index, the node group and the known models",
        ),
        pytest.param(
            "sites:\n" + site_yaml("ashburn") + site_yaml("ashburn"),
            ["site names must be unique; repeated: ashburn"],
            id="two sites with the same name are refused, naming the name",
        ),
        pytest.param(
            "brokers: {port: 9000}\n",
            ["brokers: unknown field (check the spelling)"],
            id="a misspelt top-level key is an unknown field",
        ),
        pytest.param(
            "broker: {port: 70000}\n",
            ["broker.port: Input should be less than or equal to 65535"],
            id="a port out of range names broker.port",
        ),
        pytest.param(
            "broker: {max_lost_attempts: -1}\n",
            ["broker.max_lost_attempts: Input should be greater than or equal to 0"],
            id="a negative bound on lost attempts names broker.max_lost_attempts",
        ),
        pytest.param(
            "broker: {mqtt: {max_payload_bytes: 1000}}\n",
            ["broker.mqtt.max_payload_bytes: 1000 bytes is less than 16384 (16 KiB), the least a heartbeat's report "
             "needs in one message"],
            id="a cap on MQTT messages too small for a heartbeat names broker.mqtt.max_payload_bytes and the least",
        ),
        pytest.param(
            "sites:\n" + site_yaml("ashburn").replace("latitude: 33.2", "latitude: 133.2"),
            ["sites[0].latitude: Input should be less than or equal to 90"],
            id="a latitude out of range names the site's latitude",
        ),
        pytest.param(
            "sites:\n" + site_yaml("ashburn").replace("    longitude: -80.0\n", ""),
            ["sites[0].longitude: required field is missing"],
            id="a missing field is named",
        ),
        pytest.param(
            "broker: {carbon: {kind: ftp, path: data/carbon}}\n",
            ["broker.carbon: Input tag 'ftp' found using 'kind' does not match any of the expected tags: 'files', "
             "'http'"],
            id="an unknown carbon provider kind names broker.carbon and the kinds there are",
        ),
        pytest.param(
            "broker: {carbon: {kind: http, url: not-a-url}}\n",
            ["broker.carbon.url: Input should be a valid URL"],
            id="a carbon service URL that is not one names the url field",
        ),
        pytest.param(
            "broker: {carbon_forecast: {history_h: 100}}\n",
            ["broker.carbon_forecast.history_h: history_h 100 is too short for model auto: it needs at least 216 "
             "hours"],
            id="too little forecast history for the model says how much it needs",
        ),
        pytest.param(
            "broker: {prices: {kind: files}}\n",
            ["broker.prices.path: required field is missing"],
            id="a price list without its path names the path",
        ),
        pytest.param(
            "broker: {profiles: {default: grean}}\n",
            ["broker.profiles.default: profile 'grean' is not defined; profiles are: balanced, cheap, fast, green"],
            id="a misspelt default profile names the default, not only the profiles",
        ),
        pytest.param(
            "broker: {profiles: {default: green, job_may_choose: [green, nearest]}}\n",
            ["broker.profiles.job_may_choose[1]: profile 'nearest' is not defined"],
            id="a profile jobs may choose that is not defined names its place in job_may_choose",
        ),
        pytest.param(
            "broker: {profiles: {job_may_choose: [green, green_eu],\n"
            "                    definitions: {green_eu: {weights: {carbon: 1}}}}}\n",
            ["broker.profiles.job_may_choose[1]: no job can name profile 'green_eu'",
             "lower-case letters, digits or '-'"],
            id="a profile jobs may choose under a name no job spec can hold is refused, not left unreachable",
        ),
        pytest.param(
            "broker: {prices: {kind: files, path: 'https://cloud.google.com/compute/gpus-pricing.csv'}}\n",
            ["broker.prices.path: 'https://cloud.google.com/compute/gpus-pricing.csv' is a URL; kind files reads a "
             "CSV file on this machine"],
            id="a price list given as a URL is refused at load, not read as a mangled file name at start",
        ),
        pytest.param(
            "broker: {carbon: {kind: files, path: 'https://api.electricitymap.org'}}\n",
            ["broker.carbon.path: 'https://api.electricitymap.org' is a URL; kind files reads a folder on this "
             "machine", "kind: http"],
            id="a carbon folder given as a URL points to kind http",
        ),
        pytest.param(
            "sites:\n" + site_yaml("ashburn") + "    fair_share: {mode: off}\n",
            ["sites[0].fair_share.mode: Input should be 'time', 'instant' or 'off'",
             "YAML reads an unquoted off as false: write 'off' in quotes"],
            id="an unquoted mode off, which YAML reads as false, says to quote it",
        ),
        pytest.param(
            "broker: {job_retention_h: 1.0e+9}\n",
            ["broker.job_retention_h: Input should be less than or equal to 1000000"],
            id="a retention beyond a century is refused at load, not an overflow at every round of housekeeping",
        ),
        pytest.param(
            "- just\n- a list\n",
            ["the top level must be a mapping with 'broker' and 'sites'"],
            id="a list at the top level is refused with what is expected instead",
        ),
    ],
)
def test_a_bad_config_is_a_config_error_naming_the_file_and_the_field(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    for part in expected:
        assert part in message


@pytest.mark.parametrize("name", ["green", "eu-green-2", "9", "x" * 63, "x" * 64, "Green", "green_eu", "-green", ""])
def test_a_profile_jobs_may_choose_is_refused_exactly_when_a_job_spec_could_not_name_it(name: str) -> None:
    from pydantic import ValidationError

    from broker.models import JobSpec
    from policies.profiles import ProfilesConfig

    job = {"tenant": "t1", "name": "j", "gpus": {"count": 1}, "duration_s": 60, "profile": name}
    try:
        JobSpec.model_validate(job)
        nameable = True
    except ValidationError:
        nameable = False
    definitions = {name: {"weights": {"carbon": 1.0}}}
    try:
        ProfilesConfig(job_may_choose=[name], definitions=definitions)
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted == nameable


def test_every_problem_in_a_file_is_reported_on_its_own_line(tmp_path: Path) -> None:
    text = "brokers: {}\nsites:\n" + site_yaml("ashburn", model="a1000").replace("latitude: 33.2", "latitude: 133.2")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert len(lines) == 3
    assert all(line.startswith(f"{path}: ") for line in lines)
    assert {line.split(": ")[1] for line in lines} == {"brokers", "sites[0].latitude", "sites[0].gpus[0].model"}


def test_a_check_of_the_whole_file_names_the_field_without_an_api_placeholder(tmp_path: Path) -> None:
    """Two sites of one name, or a quota beyond its site, were reported as ``file: (body): ...``: the API's word
    for a request body, which names nothing in a file."""
    quota = "    quotas: [{tenant: vision, guaranteed_gpus: 100}]\n"
    for text, expected in [
        ("sites:\n" + site_yaml("ashburn") + site_yaml("ashburn"),
         "sites[1].name: site names must be unique; repeated: ashburn"),
        ("sites:\n" + site_yaml("ashburn") + quota, "sites[0].quotas[0].guaranteed_gpus: 100 is more than the site's"),
    ]:
        path = write(tmp_path, text)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert str(err.value).startswith(f"{path}: {expected}")
        assert "(body)" not in str(err.value)


@pytest.mark.parametrize("text", [
    pytest.param("broker:\n  port: 8080\n  db: var/a.db\n  port: 9090\n", id="a setting written twice"),
    pytest.param("broker: {port: 8080}\nsites: []\nbroker: {db: var/b.db}\n", id="a second broker section"),
    pytest.param("sites:\n" + site_yaml("ashburn") + "    gpus: [{model: h100-80gb, gpus_per_node: 8, nodes: 1}]\n",
                 id="a site's gpus written twice"),
])
def test_a_key_written_twice_is_refused_naming_its_line_not_silently_half_ignored(tmp_path: Path, text: str) -> None:
    """YAML keeps the last of two equal keys, so the first was dropped without a word: a second ``broker:`` at
    the end of a file threw away every setting of the first."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"^" + re.escape(f"{path}: not valid YAML (line ") + r"\d+, column \d+\): "
                                          r"the key '\w+' appears twice"):
        load_config(path)


def test_a_merged_anchor_may_still_be_overridden_by_a_key_of_its_own(tmp_path: Path) -> None:
    text = "sites:\n" + site_yaml("ashburn").replace("  - name", "  - &first\n    name") + (
        "  - <<: *first\n    name: boston\n    latitude: 42.4\n")
    sites = load_config(write(tmp_path, text)).sites
    assert [(s.name, s.latitude, s.region) for s in sites] == [("ashburn", 33.2, "gcp:us-east1"),
                                                               ("boston", 42.4, "gcp:us-east1")]


def test_an_override_inside_an_anchor_merged_again_elsewhere_is_not_taken_for_a_key_written_twice(
        tmp_path: Path) -> None:
    # YAML splices a merged mapping's keys into it in place, and may do so for an anchored mapping merged from a
    # shallower level before that mapping is built: its own override then looked like a second key.
    text = ("base: &base {latitude: 10.0, longitude: 20.0}\ntemplates:\n  east: &east\n    <<: *base\n"
            "    latitude: 33.2\nsite_defaults:\n  <<: *east\n")
    data = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    assert data["templates"]["east"] == data["site_defaults"] == {"latitude": 33.2, "longitude": 20.0}
    with pytest.raises(yaml.YAMLError, match="the key 'latitude' appears twice"):  # written twice itself: refused
        yaml.load(text.replace("    latitude: 33.2\n", "    latitude: 33.2\n    latitude: 34.0\n"),
                  Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader


def test_invalid_yaml_reports_the_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "broker:\n  port: 8080\nsites: [\n  {name: a,\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: not valid YAML (line 5, column 1)")


def test_a_tab_in_the_indentation_reports_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "broker:\n  port: 8080\nsites:\n\t- name: a\n")
    with pytest.raises(ConfigError, match=r"not valid YAML \(line 4, column 1\)"):
        load_config(path)


def test_a_missing_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: cannot read: No such file or directory"


def test_a_directory_given_as_the_config_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path))}: cannot read: "):
        load_config(tmp_path)


def test_a_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("sites:\n  - name: z\u00fcrich\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: "):
        load_config(path)


def test_an_environment_override_that_does_not_validate_names_the_variable_to_fix() -> None:
    # The kind of provider is not a field: the variable to set is ..._CARBON__URL, not ..._CARBON__HTTP__URL.
    with pytest.raises(ConfigError) as err:
        load_config(None, {"HELIOTROPE_BROKER__CARBON": '{kind: http, url: "nope"}'})
    assert str(err.value).startswith(
        "broker.carbon.url (environment HELIOTROPE_BROKER__CARBON__URL or the file): Input should be a valid URL")
    load_config(None, {"HELIOTROPE_BROKER__CARBON": "{kind: http, url: 'https://api.example/v3'}",
                       "HELIOTROPE_BROKER__CARBON__URL": "https://api.example/v4"})


def test_an_infinite_interval_is_refused_by_name(tmp_path: Path) -> None:
    # (cycle_interval_s: .inf would leave the scheduling loop asleep for ever)
    with pytest.raises(ConfigError, match=r"broker.cycle_interval_s: Input should be a finite number"):
        load_config(write(tmp_path, "broker: {cycle_interval_s: .inf}\n"))


@pytest.mark.parametrize(
    ("setting", "maximum", "absurd"),
    [
        pytest.param("cycle_interval_s", 3600, 1e308, id="the scheduling cycle's interval is at most an hour"),
        pytest.param("min_cycle_gap_s", 3600, 1e308, id="the shortest gap between cycles is at most an hour"),
        pytest.param("collect_timeout_s", 3600, 1e308, id="a site's report is waited for an hour at most"),
        pytest.param("site_stale_after_s", 86400, 1e308, id="a site may be silent a day at most till unhealthy"),
        pytest.param("dispatch_timeout_s", 3600, 1e308, id="a dispatch is waited for an hour at most"),
        pytest.param("refusal_ttl_s", 86400, 1e308, id="a refusal is remembered a day at most"),
        pytest.param("shutdown_grace_s", 3600, 1e308, id="shutdown waits an hour at most"),
        pytest.param("carbon_forecast.stale_after_s", 604800, 1e308,
                     id="a failing zone keeps its forecast a week at most"),
        pytest.param("carbon_forecast.fetch_timeout_s", 3600, 1e308, id="a zone's fetch may take an hour at most"),
        pytest.param("profiles.definitions.slow.migrate.min_remaining_s", 366 * 86400, 1e308,
                     id="a move's least remaining run is at most the longest run a job may say"),
        pytest.param("max_body_bytes", 1 << 30, 1 << 50, id="a request body may be a GiB at most"),
    ],
)
def test_a_broker_setting_past_its_ceiling_is_refused_naming_it_in_the_file_and_the_environment(
    tmp_path: Path, setting: str, maximum: int, absurd: float
) -> None:
    """1e308 parses as a number of seconds; a cycle that far apart would never come. The ceiling itself is taken."""

    def doc(value: float) -> dict:
        node: dict = {}
        out = {"broker": node}
        parts = setting.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {"weights": {"carbon": 1}} if part == "slow" else {})
        node[parts[-1]] = value
        return out

    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, yaml.safe_dump(doc(absurd))))
    assert f"broker.{setting}: Input should be less than or equal to {maximum}" in str(err.value)
    load_config(write(tmp_path, yaml.safe_dump(doc(maximum)), "at-most.yaml"))
    if "." not in setting:  # one setting of its own: an environment variable can set it
        variable = "HELIOTROPE_BROKER__" + setting.upper()
        with pytest.raises(ConfigError, match=f"broker.{setting} \\(environment {variable} or the file\\): Input "
                                              f"should be less than or equal to {maximum}"):
            load_config(None, {variable: yaml.safe_dump(absurd)})


@pytest.mark.parametrize("field", ["burst_gpus", "guaranteed_gpus"])
def test_a_site_quota_of_absurdly_many_gpus_is_refused_at_load_naming_it(tmp_path: Path, field: str) -> None:
    text = "sites:\n" + site_yaml("ashburn") + f"    quotas: [{{tenant: t1, {field}: 1000000000000}}]\n"
    with pytest.raises(ConfigError, match=rf"sites\[0\]\.quotas\[0\]\.{field}: 1,000,000,000,000 GPUs is more than "
                                          r"the 1,000,000 a quota may give"):
        load_config(write(tmp_path, text))


def test_the_tagged_settings_errors_leave_out_are_the_models_own() -> None:
    # broker.errors.field_path drops the kind pydantic puts in an error's location; its list must follow the
    # models, or a new kind (or a new tagged field) would show up in field names and environment variables.
    from adapters.agent import AgentConfig
    from broker.config import BrokerSettings
    from broker.errors import TAGGED_FIELDS
    from broker.models import SiteSpec

    found: dict[str, set[str]] = {}
    for model in (SiteSpec, BrokerSettings, AgentConfig):
        for name, prop in model.model_json_schema()["properties"].items():
            for branch in (prop, *prop.get("anyOf", ())):
                if "discriminator" in branch:
                    found[name] = set(branch["discriminator"]["mapping"])
    assert found == {name: set(tags) for name, tags in TAGGED_FIELDS.items()}


@pytest.mark.parametrize(("name", "value", "field"), [
    ("HELIOTROPE_BROKER__HOST", "::", ("host",)),  # every IPv6 address; YAML reads it as a mapping
    ("HELIOTROPE_BROKER__DB", "2024-06-01", ("db",)),  # YAML: a date
    ("HELIOTROPE_BROKER__MQTT__HOST", "10.0", ("mqtt", "host")),  # YAML: a float
    ("HELIOTROPE_BROKER__MQTT__USERNAME", "1234", ("mqtt", "username")),  # YAML: an integer
    ("HELIOTROPE_BROKER__AUTH__ADMIN_TOKEN_ENV", "ON", ("auth", "admin_token_env")),  # YAML 1.1: a boolean
])
def test_an_environment_override_of_a_text_setting_is_taken_as_written(name: str, value: str, field: tuple) -> None:
    """A value that YAML reads as something else is, for a setting that is text, the variable's own text:
    an operator who sets ``HELIOTROPE_BROKER__HOST=::`` gets ``::``, not "Input should be a valid string"."""
    env = {name: value}
    if field[0] == "mqtt" and field[-1] != "host":
        env["HELIOTROPE_BROKER__MQTT__HOST"] = "mosquitto"
    got: object = load_config(None, env).broker
    for part in field:
        got = getattr(got, part)
    assert got == value
    # Numbers and booleans are still read as YAML, and a mistake still names the variable.
    assert load_config(None, {"HELIOTROPE_BROKER__PORT": "9090"}).broker.port == 9090
    with pytest.raises(ConfigError, match="HELIOTROPE_BROKER__PORT"):
        load_config(None, {"HELIOTROPE_BROKER__PORT": "::"})


def test_an_empty_database_setting_is_refused_naming_the_key(tmp_path: Path) -> None:
    """``db: ""`` was taken, and the broker then stopped with "cannot open database ." naming no setting."""
    with pytest.raises(ConfigError, match=r"broker\.db: empty: name an SQLite file"):
        load_config(write(tmp_path, 'broker: {db: ""}\n'))
    with pytest.raises(ConfigError, match=r"broker\.db \(environment HELIOTROPE_BROKER__DB or the file\): empty"):
        load_config(None, {"HELIOTROPE_BROKER__DB": "' '"})


@pytest.mark.parametrize(("doc", "message"), [
    ({"telemetry": {"url": "http://prometheus:9090"}}, "telemetry: kind is missing: say which, one of nvml, prometheus"),
    ({"site": {"adapter": {"state_dir": "x"}}}, "site.adapter: kind is missing: say which, one of kubernetes, mqtt, "
                                                "simulated"),
], ids=["telemetry", "adapter"])
def test_a_setting_of_several_kinds_without_its_kind_names_the_kinds(tmp_path: Path, doc: dict, message: str) -> None:
    import json

    import yaml

    from adapters.agent import load_agent_config
    from tests.builders import site

    spec = json.loads(site("lab").model_dump_json())
    full = {"site": {**spec, **doc.get("site", {})}, **{k: v for k, v in doc.items() if k != "site"}}
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(full))
    with pytest.raises(ConfigError) as raised:
        load_agent_config(path)
    assert message in str(raised.value)


def test_a_kubernetes_sites_pod_security_the_profile_forbids_is_refused_naming_the_site_and_field(
        tmp_path: Path) -> None:
    import json

    from tests.builders import site

    spec = json.loads(site("lab").model_dump_json())
    spec["adapter"] = {"kind": "kubernetes", "pod_security": "restricted", "pod_security_context": {"runAsUser": 0}}
    with pytest.raises(ConfigError, match=r"sites\[0\]\.adapter\.pod_security_context: runAsUser 0 is root"):
        load_config(write(tmp_path, yaml.safe_dump({"sites": [spec]})))


@pytest.mark.parametrize("example", ["site-example.yaml", "remote-site-example.yaml"])
def test_a_site_spec_given_as_the_broker_config_is_named_as_such_in_one_line(example: str) -> None:
    # `serve --config`, `token ... --config` and `simulate --sites` take the broker's config; a site's spec (what
    # `sites add` takes) there used to give one "unknown field (check the spelling)" per key, every one correct.
    path = REPO / "config" / example
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message == (f"{path}: this is one site's spec, not a broker config: a config lists its sites under "
                       f"'sites:' (and its settings under 'broker:', as config/demo.yaml does); register this site "
                       f"with 'heliotrope sites add {path}'")


def test_a_site_spec_given_as_the_agents_config_is_named_as_such_in_one_line() -> None:
    from adapters.agent import load_agent_config

    path = REPO / "config" / "site-example.yaml"
    with pytest.raises(ConfigError) as err:
        load_agent_config(path)
    assert str(err.value).splitlines() == [
        f"{path}: this is one site's spec, not an agent config: an agent's config holds the site under 'site:', "
        "beside 'mqtt:' and its timings (config/agent-example.yaml)"]


def test_a_config_with_a_misspelt_key_beside_a_sites_keys_is_not_taken_for_a_site_spec(tmp_path: Path) -> None:
    # Only a file with nothing but a site's keys is one: a broker config with a stray `name:` still names it.
    path = tmp_path / "broker.yaml"
    path.write_text("broker: {port: 9000}\nname: x\ngpus: []\n")
    with pytest.raises(ConfigError, match="name: unknown field"):
        load_config(path)
