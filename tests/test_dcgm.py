"""GPU telemetry from dcgm-exporter through Prometheus (adapters.dcgm), against a Prometheus stand-in.

The stand-in is an aiohttp server on a free port that answers ``GET /api/v1/query`` as Prometheus does
(``{"status": "success", "data": {"resultType": "vector", "result": [...]}}``) from series shaped as
dcgm-exporter writes them, and applies the ``=`` matchers of a query's selector. It records each query and
its Authorization header, and can be told to fail, stall or answer garbage for one metric.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import kmock
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from adapters.agent import AgentConfig, SiteAgent, load_agent_config
from adapters.dcgm import PrometheusError, PrometheusSource
from adapters.kubernetes import KubernetesSite
from adapters.nvml import clock_event_bits, decode_reasons
from adapters.telemetry import telemetry_feed
from broker.clock import SystemClock
from broker.config import ConfigError
from broker.models import KubernetesAdapterConfig, PrometheusTelemetryConfig, SimulatedAdapterConfig
from tests.builders import site
from tests.test_kubernetes import cluster  # noqa: F401 - the kmock Kubernetes emulator fixture

H100 = "NVIDIA H100 80GB HBM3"
FB_TOTAL_MIB = 81_559  # what an H100 80GB's used + free add up to
TEMP, POWER, UTIL = "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_UTIL"
FB_USED, FB_FREE = "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"
REASONS, OLD_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"

# Two nodes of two H100 in cluster lon-1, and a hotter node in par-2 that lon-1's selector must leave out.
#      cluster   host     gpu  °C   W      util %  FB used MiB  clock-event reasons
GPUS = [("lon-1", "gpu-a", 0, 64, 612.5, 100, 70_000, 0x0),
        ("lon-1", "gpu-a", 1, 66, 598.0, 95, 65_000, 0x0),
        ("lon-1", "gpu-b", 0, 41, 71.25, 0, 0, 0x1),  # idle: low clocks, not held down
        ("lon-1", "gpu-b", 1, 87, 402.75, 97, 72_000, 0x60),  # sw and hw thermal slowdown
        ("par-2", "gpu-p", 0, 95, 700.0, 100, 80_000, 0x4)]


def labels(name: str, cluster: str, host: str, gpu: int) -> dict[str, str]:
    """A series' labels as Prometheus returns them for dcgm-exporter (the target's labels added)."""
    return {"__name__": name, "gpu": str(gpu), "UUID": f"GPU-{host}-{gpu:04d}-8f6b-1c2d-3e4f", "device": f"nvidia{gpu}",
            "pci_bus_id": f"00000000:{0x18 + gpu:02X}:00.0", "modelName": H100, "Hostname": host,
            "DCGM_FI_DRIVER_VERSION": "550.90.07", "instance": f"{host}.lon:9400", "job": "gpu-metrics",
            "cluster": cluster}


def recorded(reasons_metric: str | None = REASONS) -> dict[str, list[dict[str, Any]]]:
    """Every metric's series for GPUS, the reasons under ``reasons_metric`` (None: not exported)."""
    out: dict[str, list[dict[str, Any]]] = {}

    def add(name: str, cluster: str, host: str, gpu: int, value: float) -> None:
        out.setdefault(name, []).append({"metric": labels(name, cluster, host, gpu),
                                         "value": [1764417600.123, str(value)]})

    for cluster_, host, gpu, temp, power, util, used, reasons in GPUS:
        add(TEMP, cluster_, host, gpu, temp)
        add(POWER, cluster_, host, gpu, power)
        add(UTIL, cluster_, host, gpu, util)
        add(FB_USED, cluster_, host, gpu, used)
        add(FB_FREE, cluster_, host, gpu, FB_TOTAL_MIB - used)
        if reasons_metric is not None:
            add(reasons_metric, cluster_, host, gpu, reasons)
    return out


@dataclass
class Query:
    metric: str
    promql: str
    authorization: str | None


@dataclass
class FakePrometheus:
    series: dict[str, list[dict[str, Any]]]
    url: str = ""
    queries: list[Query] = field(default_factory=list)
    answers: dict[str, list[web.Response]] = field(default_factory=dict)  # metric -> served first, in turn
    stall_s: dict[str, float] = field(default_factory=dict)

    def asked(self, metric: str) -> int:
        return sum(1 for q in self.queries if q.metric == metric)

    async def handle(self, request: web.Request) -> web.Response:
        promql = request.query["query"]
        metric, _, selector = promql.partition("{")
        self.queries.append(Query(metric, promql, request.headers.get("Authorization")))
        if metric in self.stall_s:
            await asyncio.sleep(self.stall_s[metric])
        if self.answers.get(metric):
            return self.answers[metric].pop(0)
        matchers = dict(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"([^"]*)"', selector))
        result = [s for s in self.series.get(metric, [])
                  if all(s["metric"].get(k) == v for k, v in matchers.items())]
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})


@pytest.fixture
async def prometheus() -> AsyncIterator[FakePrometheus]:
    fake = FakePrometheus(recorded())
    app = web.Application()
    app.router.add_get("/api/v1/query", fake.handle)
    server = TestServer(app, host="127.0.0.1")  # a free port
    await server.start_server()
    fake.url = str(server.make_url("")).rstrip("/")
    try:
        yield fake
    finally:
        await server.close()


def source(fake: FakePrometheus, environ: dict[str, str] | None = None, **settings: Any) -> PrometheusSource:
    config = PrometheusTelemetryConfig(url=fake.url, **({"selector": 'cluster="lon-1"'} | settings))
    return PrometheusSource(config, environ=environ or {}, backoff_s=0.01)


async def read(fake: FakePrometheus, environ: dict[str, str] | None = None, **settings: Any):  # noqa: ANN201
    src = source(fake, environ, **settings)
    try:
        return await src.read()
    finally:
        await src.aclose()


def error(status: int, error_type: str, message: str) -> web.Response:
    return web.json_response({"status": "error", "errorType": error_type, "error": message}, status=status)


# --- what is read -----------------------------------------------------------------------------------------


async def test_a_clusters_gpus_fold_into_one_reading_with_the_share_held_down_by_heat(prometheus) -> None:
    telemetry = await read(prometheus)
    assert telemetry.temperature_c_max == 87.0  # the hottest GPU
    assert telemetry.power_w == pytest.approx(612.5 + 598.0 + 71.25 + 402.75)  # summed
    assert telemetry.gpu_utilisation_pct == pytest.approx((100 + 95 + 0 + 97) / 4)  # the mean
    assert telemetry.memory_used_gib == pytest.approx(207_000 / 1024)  # MiB → GiB, summed
    assert telemetry.memory_total_gib == pytest.approx(4 * FB_TOTAL_MIB / 1024)  # used + free
    assert telemetry.throttled_pct == 25.0  # one GPU of four: thermal slowdown (the idle one is not held down)
    assert telemetry.throttle_reasons == {"hw_thermal": 1, "idle": 1, "sw_thermal": 1}
    assert telemetry.queue_depth == 0  # the GPUs do not know the site's queue; the feed keeps the adapter's


async def test_the_selector_goes_into_every_query_and_keeps_other_clusters_out(prometheus) -> None:
    everything = await read(prometheus, selector="")
    lon = await read(prometheus, selector='cluster="lon-1"')
    assert (everything.temperature_c_max, lon.temperature_c_max) == (95.0, 87.0)  # par-2's 95 °C GPU left out
    asked = [q.promql for q in prometheus.queries[-7:]]
    assert sorted(asked) == sorted(f'{m}{{cluster="lon-1"}}' for m in (TEMP, POWER, UTIL, FB_USED, FB_FREE, REASONS,
                                                                       OLD_REASONS))


async def test_the_older_name_of_the_reasons_metric_is_read_where_the_newer_has_no_series(prometheus) -> None:
    prometheus.series = recorded(reasons_metric=OLD_REASONS)  # dcgm-exporter on DCGM before 3.3
    telemetry = await read(prometheus)
    assert telemetry.throttled_pct == 25.0
    assert telemetry.throttle_reasons == {"hw_thermal": 1, "idle": 1, "sw_thermal": 1}


async def test_without_a_reasons_metric_throttling_is_not_reported_and_the_rest_is(prometheus) -> None:
    prometheus.series = recorded(reasons_metric=None)  # dcgm-exporter's default counters
    telemetry = await read(prometheus)
    assert telemetry.throttled_pct is None and telemetry.throttle_reasons == {}
    assert "throttled_pct" not in telemetry.wire()  # a heartbeat leaves it out: not reported, not 0 %
    assert telemetry.temperature_c_max == 87.0


@pytest.mark.parametrize(("mask", "reasons"), [
    (0x0, ()),
    (0x1, ("idle",)),
    (0x2, ("applications_clocks",)),
    (0x4, ("sw_power_cap",)),
    (0x8, ("hw_slowdown",)),
    (0x10, ("sync_boost",)),
    (0x20, ("sw_thermal",)),
    (0x40, ("hw_thermal",)),
    (0x80, ("power_brake",)),
    (0x100, ("display_clock",)),
    (0xC4, ("sw_power_cap", "hw_thermal", "power_brake")),
], ids=lambda v: hex(v) if isinstance(v, int) else ",".join(v) or "none")
def test_dcgms_reason_bits_are_nvmls_and_decode_to_the_same_names(mask: int, reasons: tuple[str, ...]) -> None:
    assert decode_reasons(mask, clock_event_bits()) == reasons


async def test_a_mig_gpu_counts_once_with_the_memory_of_its_instances(prometheus) -> None:
    # dcgm-exporter repeats a MIG GPU's device metrics on each of its instances (labels GPU_I_ID, GPU_I_PROFILE)
    mig: dict[str, list[dict[str, Any]]] = {}
    for gi, used in (("1", 4_000), ("2", 9_000)):
        for name, value in ((TEMP, 58), (POWER, 250.0), (FB_USED, used), (FB_FREE, 10_000 - used), (REASONS, 0x4)):
            series = labels(name, "lon-1", "gpu-m", 0) | {"GPU_I_ID": gi, "GPU_I_PROFILE": "2g.20gb"}
            mig.setdefault(name, []).append({"metric": series, "value": [1764417600.1, str(value)]})
    prometheus.series = mig
    telemetry = await read(prometheus)
    assert (telemetry.power_w, telemetry.temperature_c_max) == (250.0, 58.0)  # one GPU, not two
    assert telemetry.memory_used_gib == pytest.approx(13_000 / 1024)  # its instances' memory, summed
    assert telemetry.throttle_reasons == {"sw_power_cap": 1}
    assert telemetry.throttled_pct == 0.0  # at its own power cap: busy, not held down by heat


# --- what fails, and how ----------------------------------------------------------------------------------


async def test_a_503_is_retried_and_the_reading_succeeds(prometheus) -> None:
    prometheus.answers[TEMP] = [error(503, "unavailable", "too many concurrent queries")]
    telemetry = await read(prometheus)
    assert telemetry.temperature_c_max == 87.0
    assert prometheus.asked(TEMP) == 2


async def test_a_400_is_not_retried_and_the_error_names_the_metric_and_prometheuss_words(prometheus) -> None:
    prometheus.answers[POWER] = [error(400, "bad_data", 'invalid parameter "query": 1:24: parse error')]
    with pytest.raises(PrometheusError, match=rf"{POWER}.*HTTP 400.*parse error"):
        await read(prometheus)
    assert prometheus.asked(POWER) == 1


async def test_prometheus_that_keeps_failing_is_given_up_on_after_three_attempts(prometheus) -> None:
    prometheus.answers[UTIL] = [error(503, "unavailable", "overloaded") for _ in range(5)]
    with pytest.raises(PrometheusError, match=rf"{UTIL}.*503.*gave up after 3 attempts"):
        await read(prometheus)
    assert prometheus.asked(UTIL) == 3


async def test_a_query_that_does_not_answer_in_timeout_s_fails_the_reading(prometheus) -> None:
    prometheus.stall_s[FB_FREE] = 1.0
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(PrometheusError, match=rf"{FB_FREE}.*no answer within 0.2 s"):
        await read(prometheus, timeout_s=0.2)
    assert loop.time() - started < 0.9  # not retried
    assert prometheus.asked(FB_FREE) == 1


@pytest.mark.parametrize(("answer", "message"), [
    (web.Response(text="<html>Grafana</html>", content_type="text/html"), "not JSON.*Grafana"),
    (web.json_response({"status": "error", "errorType": "execution", "error": "query timed out in expression "
                                                                               "evaluation"}),
     "query timed out"),
    (web.json_response({"status": "success", "data": {"resultType": "matrix", "result": []}}), "not an instant vector"),
], ids=["a body that is not JSON", "an error status", "a matrix, not a vector"])
async def test_an_answer_that_is_not_an_instant_vector_fails_naming_the_metric(prometheus, answer, message) -> None:
    prometheus.answers[TEMP] = [answer]
    with pytest.raises(PrometheusError, match=rf"{TEMP}.*{message}"):
        await read(prometheus)


@pytest.mark.parametrize(("metric", "value", "message"), [
    (TEMP, "NaN", "DCGM_FI_DEV_GPU_TEMP is NaN for GPU GPU-gpu-b-0001.*not a number"),
    (UTIL, "+Inf", "DCGM_FI_DEV_GPU_UTIL is \\+Inf"),
    (UTIL, "140", "DCGM_FI_DEV_GPU_UTIL is 140 % for GPU GPU-gpu-b-0001.*outside 0 to 100 %"),
    (FB_USED, "-1", "DCGM_FI_DEV_FB_USED is -1 MiB .*outside 0 to 4194304 MiB"),
    (REASONS, "16777216", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS is 16777216 .*not a clock-event"),
    (REASONS, "2.5", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS is 2.5 .*a whole number from 0 to 0xffffff"),
], ids=["a NaN temperature", "an infinite utilisation", "utilisation above 100 %", "negative memory",
        "a mask with bits far above NVML's",
        "a mask that is not a whole number"])
async def test_a_value_that_cannot_be_a_reading_fails_it_naming_the_metric_and_gpu(
        prometheus, metric: str, value: str, message: str) -> None:
    prometheus.series[metric][3]["value"][1] = value
    with pytest.raises(PrometheusError, match=message):
        await read(prometheus)


async def test_a_series_without_a_usable_value_is_skipped_and_the_others_count(prometheus, caplog) -> None:
    prometheus.series[TEMP][3]["value"] = [1764417600.1, "hot"]  # the 87 °C GPU's temperature is garbage
    del prometheus.series[POWER][0]["value"]
    with caplog.at_level(logging.WARNING, logger="adapters.dcgm"):
        telemetry = await read(prometheus)
    assert telemetry.temperature_c_max == 66.0
    assert telemetry.power_w == pytest.approx(598.0 + 71.25 + 402.75)
    assert telemetry.throttled_pct == 25.0  # its clock-event reasons still count
    assert f"{TEMP}: 1 series without a value" in caplog.text


@pytest.mark.parametrize("blank", ["9223372036854775794", "2147483632", "140737488355328"],
                         ids=["DCGM_INT64_NOT_SUPPORTED", "DCGM_INT32_BLANK", "DCGM_FP64_BLANK"])
async def test_a_field_dcgm_has_no_value_for_leaves_that_gpu_out_of_that_metric(prometheus, blank: str) -> None:
    # dcgm-exporter passes DCGM's "no value" sentinels on (its own README shows 9223372036854775794)
    prometheus.series[REASONS][3]["value"][1] = blank  # the thermal-throttled GPU's reasons are not reported
    prometheus.series[TEMP][3]["value"][1] = blank
    telemetry = await read(prometheus)
    assert telemetry.throttled_pct == 0.0  # over the three GPUs whose reasons were read
    assert telemetry.throttle_reasons == {"idle": 1}
    assert telemetry.temperature_c_max == 66.0


async def test_a_selector_that_matches_no_gpu_fails_the_reading_and_says_what_to_check(prometheus) -> None:
    with pytest.raises(PrometheusError, match=r'no GPU series: DCGM_FI_DEV_GPU_TEMP\{cluster="lon-2"\}.*selector'):
        await read(prometheus, selector='cluster="lon-2"')


# --- credentials ------------------------------------------------------------------------------------------


async def test_the_bearer_token_comes_from_token_env_and_is_in_no_error(prometheus) -> None:
    await read(prometheus, {"PROM_TOKEN": " s3cret-token\n"}, token_env="PROM_TOKEN")
    assert {q.authorization for q in prometheus.queries} == {"Bearer s3cret-token"}
    prometheus.answers[TEMP] = [web.Response(status=401, text="Unauthorized")]
    with pytest.raises(PrometheusError) as refused:
        await read(prometheus, {"PROM_TOKEN": "wrong-token"}, token_env="PROM_TOKEN")
    assert "HTTP 401" in str(refused.value) and "$PROM_TOKEN" in str(refused.value)
    assert "wrong-token" not in str(refused.value)


async def test_a_token_env_that_is_not_set_fails_each_reading_with_its_name_and_asks_nothing(prometheus) -> None:
    with pytest.raises(PrometheusError, match=r"token_env names \$PROM_TOKEN, which is not set"):
        await read(prometheus, {}, token_env="PROM_TOKEN")
    assert prometheus.queries == []


async def test_without_token_env_no_authorization_is_sent(prometheus) -> None:
    await read(prometheus)
    assert {q.authorization for q in prometheus.queries} == {None}


# --- a Kubernetes site the broker runs --------------------------------------------------------------------


async def test_a_kubernetes_site_with_telemetry_reports_what_dcgm_exporter_measures(
        cluster: kmock.KubernetesEmulator, prometheus) -> None:  # noqa: F811
    config = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), request_timeout_s=5, retries=2,
                                     telemetry={"kind": "prometheus", "url": prometheus.url,
                                                "selector": 'cluster="lon-1"', "every_s": 30})
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    await adapter.start()  # reads in the background: the start does not wait for Prometheus
    try:
        async with asyncio.timeout(10):
            while (state := await adapter.snapshot()).telemetry.throttled_pct is None:
                await asyncio.sleep(0.05)
    finally:
        await adapter.close()
    assert state.telemetry.temperature_c_max == 87.0
    assert state.telemetry.throttled_pct == 25.0
    assert state.telemetry.throttle_reasons == {"hw_thermal": 1, "idle": 1, "sw_thermal": 1}
    assert state.telemetry.memory_total_gib == pytest.approx(4 * FB_TOTAL_MIB / 1024)  # measured, not the Nodes'
    assert state.capacity[0].total_gpus == 19  # capacity still comes from the Nodes


async def test_a_kubernetes_site_without_telemetry_reports_only_its_nodes_memory(
        cluster: kmock.KubernetesEmulator) -> None:  # noqa: F811
    config = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), request_timeout_s=5, retries=2)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    await adapter.start()
    try:
        state = await adapter.snapshot()
    finally:
        await adapter.close()
    assert adapter.telemetry is None
    assert (state.telemetry.temperature_c_max, state.telemetry.throttled_pct) == (0.0, None)


def test_nvml_is_not_a_kubernetes_sites_telemetry() -> None:
    # the broker runs a Kubernetes site's adapter away from its GPU nodes, where NVML would see no GPUs
    with pytest.raises(ValueError, match="kind nvml would read the GPUs of the machine the broker runs on"):
        KubernetesAdapterConfig(telemetry={"kind": "nvml"})


# --- configuration ----------------------------------------------------------------------------------------


def agent_doc(telemetry: dict[str, Any]) -> dict[str, Any]:
    spec = site("lab", gpus={"a100-80gb": 8}, adapter=SimulatedAdapterConfig().model_dump())
    return {"site": json.loads(spec.model_dump_json()), "telemetry": telemetry}


def test_an_agent_config_asks_for_prometheus_telemetry_by_kind(tmp_path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(agent_doc({"kind": "prometheus", "url": "http://prometheus.monitoring:9090/",
                                              "selector": 'cluster="lon-1"', "token_env": "PROM_TOKEN"})))
    config = load_agent_config(path)
    assert isinstance(config.telemetry, PrometheusTelemetryConfig)
    assert (config.telemetry.url, config.telemetry.every_s, config.telemetry.stale_after_s,
            config.telemetry.timeout_s) == ("http://prometheus.monitoring:9090", 30.0, 120.0, 5.0)
    feed = SiteAgent(config).telemetry
    assert feed is not None and isinstance(feed.source, PrometheusSource)
    assert feed.source.query_url == "http://prometheus.monitoring:9090/api/v1/query"


@pytest.mark.parametrize(("telemetry", "message"), [
    ({"kind": "prometheus", "url": "prometheus:9090"}, "telemetry.url: must be an http:// or https:// URL"),
    ({"kind": "prometheus", "url": "http://admin:hunter2@prom:9090"}, "telemetry.url: must not carry credentials"),
    ({"kind": "prometheus", "url": "http://prometheus:9090/?query=up"}, "telemetry.url: must be the server's base URL"),
    ({"kind": "prometheus"}, "telemetry.url: required field is missing"),
    ({"kind": "prometheus", "url": "http://p:9090", "selector": '{cluster="lon-1"}'},
     "telemetry.selector: .* is not PromQL label matchers"),
    ({"kind": "prometheus", "url": "http://p:9090", "selector": 'cluster="a"} or vector(1) or up{a="b"'},
     "telemetry.selector: .* is not PromQL label matchers"),
    ({"kind": "prometheus", "url": "http://p:9090", "selector": '__name__=~".+"'}, "telemetry.selector: may not match"),
    ({"kind": "prometheus", "url": "http://p:9090", "ca_file": "/etc/ca.pem"}, "ca_file verifies an https server"),
    ({"kind": "prometheus", "url": "http://p:9090", "token_env": "PROM TOKEN"}, "telemetry.token_env"),
    ({"kind": "prometheus", "url": "http://p:9090", "every_s": 0}, "telemetry.every_s"),
    ({"kind": "dcgm", "url": "http://p:9090"}, "telemetry"),
], ids=["a url without a scheme", "a url with credentials", "a url with a query", "no url",
        "a selector in braces", "a selector that breaks out of its braces", "a selector on __name__",
        "a ca_file for http", "a token_env that is no variable name", "every_s 0", "a kind that does not exist"])
def test_an_agent_config_with_bad_prometheus_settings_is_refused_naming_the_field(tmp_path, telemetry, message) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(agent_doc(telemetry)))
    with pytest.raises(ConfigError, match=message):
        load_agent_config(path)


def test_telemetry_set_both_for_the_agent_and_its_kubernetes_site_is_refused() -> None:
    telemetry = {"kind": "prometheus", "url": "http://p:9090"}
    spec = site("lab", adapter={"kind": "kubernetes", "telemetry": telemetry})
    with pytest.raises(ValueError, match="telemetry is set twice"):
        AgentConfig(site=spec, telemetry=telemetry)


async def test_the_feed_factory_builds_the_source_each_kind_asks_for(prometheus) -> None:
    feed = telemetry_feed("lab", PrometheusTelemetryConfig(url=prometheus.url, every_s=5, stale_after_s=20))
    assert (feed.every_s, feed.stale_after_s) == (5, 20)
    assert await feed.read_once()
    assert feed.fresh() is not None and feed.fresh().temperature_c_max == 95.0  # no selector: both clusters
    await feed.stop()


async def test_a_kubernetes_site_starts_and_reports_while_its_prometheus_never_answers(
        cluster: kmock.KubernetesEmulator) -> None:  # noqa: F811
    """A Prometheus that takes connections and never answers must not hold up the site's start or its
    reports (the broker gives a report 2 s): the readings run in the background."""
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), request_timeout_s=5, retries=2,
                                     telemetry={"kind": "prometheus", "url": f"http://127.0.0.1:{port}",
                                                "timeout_s": 30})
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    try:
        async with asyncio.timeout(2):
            await adapter.start()
            state = await adapter.snapshot()
        assert state.health == "healthy" and state.telemetry.throttled_pct is None  # its own, for now
    finally:
        await adapter.close()
        server.close()


async def test_an_answer_too_large_to_be_one_sites_gpus_fails_the_reading_and_names_the_cure(prometheus,
                                                                                           monkeypatch) -> None:
    monkeypatch.setattr("adapters.dcgm.MAX_ANSWER_BYTES", 200)  # the recorded answers are larger than this
    with pytest.raises(PrometheusError, match="the answer is over .* MiB; narrow the selector"):
        await read(prometheus)
