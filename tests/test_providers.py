"""Carbon and price providers: the file provider on the shipped slice, the HTTP provider against a local server
that answers in the Electricity Maps v3 shape with answers recorded from the same slice
(tests/data/electricitymaps/), its cache, timeouts, retries, errors and gaps, and the provider configs."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import ValidationError

from broker.clock import ManualClock
from broker.data.prices import load_gcp_prices
from broker.providers import (
    CarbonProvider,
    FileCarbonProvider,
    FilePriceProvider,
    FilesCarbonConfig,
    HttpCarbonConfig,
    HttpCarbonProvider,
    ProviderError,
    StaticPriceProvider,
    build_carbon_provider,
    build_price_provider,
    parse_carbon_provider_config,
    parse_price_provider_config,
)
from broker.providers import carbon as carbon_module
from tests.builders import site

ROOT = Path(__file__).resolve().parents[1]
RECORDED = Path(__file__).resolve().parent / "data" / "electricitymaps"
PRICES = ROOT / "data" / "prices" / "gcp_gpu_instance_prices.csv"
H = timedelta(hours=1)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


FIRST, END = utc(2022, 6, 1), utc(2022, 6, 8)  # what the recordings cover: 168 hours
SERVICE_NOW = utc(2022, 6, 7, 23, 30)  # when the recordings were "made": history = 2022-06-07, latest = 23:00
TOKEN = "s3cr3t-T0KEN-value"


# --- a local Electricity Maps v3 service serving the recordings ------------------------------------------------


@dataclass
class Reply:
    """A scripted answer, served (in order) before the recordings."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


class FakeElectricityMaps:
    def __init__(self) -> None:
        self.zones: dict[str, list[dict[str, Any]]] = {}
        self.recorded: dict[tuple[str, str], Any] = {}
        for f in sorted(RECORDED.glob("*.json")):
            zone, endpoint, _ = f.name.split(".")
            self.recorded[(zone, endpoint)] = json.loads(f.read_text(encoding="utf-8"))
        self.requests: list[tuple[str, dict[str, str], str | None]] = []  # (endpoint, query, auth-token)
        self.script: list[Reply] = []
        self.drop: set[str] = set()  # datetimes ("2022-06-03T10:00:00.000Z") left out of every answer
        self.null: set[str] = set()  # datetimes answered with carbonIntensity null
        self.token: str | None = None  # when set, a request without this auth-token gets 401
        self.url = ""
        self.app = web.Application()
        self.app.router.add_get("/v3/carbon-intensity/{endpoint}", self.handle)

    def count(self, endpoint: str | None = None) -> int:
        return sum(1 for e, _, _ in self.requests if endpoint is None or e == endpoint)

    def _entries(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for e in entries:
            if e["datetime"] in self.drop:
                continue
            out.append({**e, "carbonIntensity": None} if e["datetime"] in self.null else e)
        return out

    async def handle(self, request: web.Request) -> web.StreamResponse:
        endpoint = request.match_info["endpoint"]
        query = dict(request.query)
        self.requests.append((endpoint, query, request.headers.get("auth-token")))
        if self.script:
            reply = self.script.pop(0)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.status != 200 or reply.body is not None:
                return web.json_response(reply.body or {"message": "scripted"}, status=reply.status,
                                         headers=reply.headers)
        if self.token is not None and request.headers.get("auth-token") != self.token:
            return web.json_response({"message": f"Invalid auth-token {request.headers.get('auth-token')}"}, status=401)
        if query.get("emissionFactorType") != "direct":
            return web.json_response({"message": "only direct emission factors are recorded"}, status=400)
        zone = query.get("zone", "")
        if (zone, endpoint) not in self.recorded:
            return web.json_response({"message": f"zone {zone!r} or endpoint {endpoint!r} not recorded"}, status=404)
        payload = self.recorded[(zone, endpoint)]
        if endpoint == "latest":
            return web.json_response(payload)
        if endpoint == "history":
            return web.json_response({**payload, "history": self._entries(payload["history"])})
        start, end = datetime.fromisoformat(query["start"]), datetime.fromisoformat(query["end"])
        if end - start > timedelta(days=10):
            return web.json_response({"message": "the range is longer than 10 days"}, status=400)
        data = [e for e in payload["data"] if start <= datetime.fromisoformat(e["datetime"]) < end]
        return web.json_response({**payload, "data": self._entries(data)})


@pytest.fixture
async def em() -> AsyncIterator[FakeElectricityMaps]:
    fake = FakeElectricityMaps()
    server = TestServer(fake.app, host="127.0.0.1")  # a free port
    await server.start_server()
    fake.url = str(server.make_url("")).rstrip("/")
    yield fake
    await server.close()


@pytest.fixture
async def http(em: FakeElectricityMaps) -> AsyncIterator[Callable[..., HttpCarbonProvider]]:
    """``http(**kwargs)``: an HttpCarbonProvider on the local service, small waits, clock at SERVICE_NOW."""
    made: list[HttpCarbonProvider] = []

    def make(**kwargs: Any) -> HttpCarbonProvider:
        kwargs = {"timeout_s": 2.0, "backoff_s": 0.01, "max_backoff_s": 0.05, "clock": ManualClock(SERVICE_NOW),
                  **kwargs}
        p = HttpCarbonProvider(kwargs.pop("base_url", em.url), **kwargs)
        made.append(p)
        return p

    yield make
    for p in made:
        await p.close()


@pytest.fixture(scope="module")
def files() -> FileCarbonProvider:
    return FileCarbonProvider.load(ROOT / "data" / "carbon")


# --- the HTTP provider gives what the files give ----------------------------------------------------------------


@pytest.mark.parametrize("zone", ["GB", "DE-LU", "germany"])
async def test_http_history_equals_the_files(em, http, files, zone) -> None:
    p = http()
    got = await p.history(zone, FIRST, END)
    want = await files.history(zone, FIRST, END)
    assert got.dtype == np.float64 and len(got) == 168
    np.testing.assert_array_equal(got, want)
    # a span older than the last 24 h is one past-range request, for the service's zone id, direct intensity
    assert em.count() == em.count("past-range") == 1
    _, query, token = em.requests[0]
    assert query == {"zone": "GB" if zone == "GB" else "DE", "start": "2022-06-01T00:00:00Z",
                     "end": "2022-06-08T00:00:00Z", "emissionFactorType": "direct"}
    assert token is None


async def test_recent_hours_come_from_the_history_endpoint(em, http, files) -> None:
    p = http()
    got = await p.history("GB", utc(2022, 6, 7), END)
    np.testing.assert_array_equal(got, await files.history("GB", utc(2022, 6, 7), END))
    assert em.count("history") == 1 and em.count("past-range") == 0


async def test_long_spans_are_asked_in_pieces(em, http, files, monkeypatch) -> None:
    monkeypatch.setattr(carbon_module, "MAX_RANGE_HOURS", 72)
    p = http()
    got = await p.history("GB", FIRST, END)
    np.testing.assert_array_equal(got, await files.history("GB", FIRST, END))
    assert [(q["start"], q["end"]) for _, q, _ in em.requests] == [
        ("2022-06-01T00:00:00Z", "2022-06-04T00:00:00Z"),
        ("2022-06-04T00:00:00Z", "2022-06-07T00:00:00Z"),
        ("2022-06-07T00:00:00Z", "2022-06-08T00:00:00Z"),
    ]


async def test_latest_is_the_hour_containing_now(em, http, files) -> None:
    p = http()
    # the service's latest reading is for 23:00: the hour containing now
    assert await p.latest("GB", utc(2022, 6, 7, 23, 10)) == await files.latest("GB", utc(2022, 6, 7, 23, 10))
    # just after the hour turns, the service may still have the hour before: accepted (1 h lag)
    assert await p.latest("GB", utc(2022, 6, 8, 0, 5)) == await files.latest("GB", utc(2022, 6, 7, 23, 0))
    # now in the past for the service (a replay): the hour comes from the hourly data
    assert await p.latest("DE-LU", utc(2022, 6, 3, 5, 30)) == await files.latest("DE-LU", utc(2022, 6, 3, 5, 30))
    assert em.count("past-range") == 1
    # a reading older than that is refused
    with pytest.raises(ProviderError, match=r"zone GB: GET /v3/carbon-intensity/latest\?zone=GB: the service's "
                                            r"latest reading is for 2022-06-07T23:00Z, more than 1 h before"):
        await p.latest("GB", utc(2022, 6, 8, 3))


async def test_empty_span_and_caller_mistakes(http) -> None:
    p = http()
    assert len(await p.history("GB", FIRST, FIRST)) == 0
    with pytest.raises(ValueError, match="start must be timezone-aware"):
        await p.history("GB", datetime(2022, 6, 1), END)
    with pytest.raises(ValueError, match="end must be on the hour"):
        await p.history("GB", FIRST, END + timedelta(minutes=30))
    with pytest.raises(ValueError, match="is before start"):
        await p.history("GB", END, FIRST)
    with pytest.raises(ValueError, match="not a grid zone id"):
        await p.latest("not a zone!", SERVICE_NOW)


# --- the cache --------------------------------------------------------------------------------------------------


async def test_repeated_calls_within_the_ttl_make_no_request(em, http) -> None:
    p = http(cache_ttl_s=300)
    first = await p.history("GB", FIRST, END)
    again = await p.history("GB", FIRST, END)
    part = await p.history("GB", utc(2022, 6, 2), utc(2022, 6, 3))  # inside what was fetched
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(part, first[24:48])
    assert em.count() == 1
    a = await p.latest("GB", utc(2022, 6, 7, 23, 5))
    b = await p.latest("GB", utc(2022, 6, 7, 23, 55))  # the same hour
    assert a == b and em.count("latest") == 1


async def test_a_zero_ttl_turns_the_cache_off(em, http) -> None:
    p = http(cache_ttl_s=0)
    await p.history("GB", FIRST, END)
    await p.history("GB", FIRST, END)
    await p.latest("GB", SERVICE_NOW)
    await p.latest("GB", SERVICE_NOW)
    assert em.count("past-range") == 2 and em.count("latest") == 2


async def test_the_cache_expires(em, http) -> None:
    p = http(cache_ttl_s=0.05)
    await p.latest("GB", SERVICE_NOW)
    await asyncio.sleep(0.1)
    await p.latest("GB", SERVICE_NOW)
    assert em.count("latest") == 2


# --- timeouts, retries, errors -------------------------------------------------------------------------------------


async def test_a_service_slower_than_the_timeout_is_retried_then_named(em, http) -> None:
    em.script = [Reply(delay_s=0.3) for _ in range(3)]
    p = http(timeout_s=0.05, retries=2)
    with pytest.raises(ProviderError) as err:
        await p.latest("GB", SERVICE_NOW)
    assert str(err.value) == ("carbon provider: zone GB: GET /v3/carbon-intensity/latest?zone=GB: "
                              "no answer within 0.05 s; gave up after 3 attempts")
    assert em.count() == 3


async def test_server_errors_are_retried_and_then_succeed(em, http, files, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="broker.providers.carbon")
    em.script = [Reply(503), Reply(502)]
    p = http(retries=3)
    got = await p.history("GB", FIRST, END)
    np.testing.assert_array_equal(got, await files.history("GB", FIRST, END))
    assert em.count() == 3
    retries = [r.getMessage() for r in caplog.records]
    assert len(retries) == 2 and "HTTP 503 Service Unavailable; retry 1 of 3" in retries[0]


async def test_retries_give_up_with_the_last_reason(em, http) -> None:
    em.script = [Reply(500) for _ in range(2)]
    p = http(retries=1)
    with pytest.raises(ProviderError, match=r"zone GB: .*: HTTP 500 Internal Server Error; gave up after 2 attempts$"):
        await p.latest("GB", SERVICE_NOW)
    assert em.count() == 2


async def test_a_refused_token_fails_at_once_and_is_never_shown(em, http, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    em.token = "the-right-one"
    p = http(token=TOKEN, token_env="EM_TOKEN")
    with pytest.raises(ProviderError) as err:
        await p.history("GB", FIRST, END)
    message = str(err.value)
    assert message == ("carbon provider: zone GB: GET /v3/carbon-intensity/past-range?zone=GB"
                       "&start=2022-06-01T00:00:00Z&end=2022-06-08T00:00:00Z: "
                       "HTTP 401 Unauthorized: the service refused the request; check $EM_TOKEN")
    assert em.count() == 1  # not retried
    assert em.requests[0][2] == TOKEN  # sent as the auth-token header
    assert TOKEN not in message and TOKEN not in caplog.text and TOKEN not in repr(p)
    # without a token the message says so
    q = http()
    with pytest.raises(ProviderError, match="HTTP 401 Unauthorized: .*no token was given"):
        await q.latest("GB", SERVICE_NOW)


async def test_the_right_token_is_accepted(em, http) -> None:
    em.token = TOKEN
    p = http(token=TOKEN)
    assert await p.latest("GB", SERVICE_NOW) > 0


async def test_other_client_errors_are_not_retried(em, http) -> None:
    p = http(lifecycle=True)  # the recordings hold direct intensity only: the service says 400
    with pytest.raises(ProviderError, match=r"HTTP 400 Bad Request: only direct emission factors are recorded$"):
        await p.latest("GB", SERVICE_NOW)
    with pytest.raises(ProviderError, match=r"zone FR: GET /v3/carbon-intensity/latest\?zone=FR: HTTP 404 Not Found: "):
        await http().latest("FR", SERVICE_NOW)
    assert em.count() == 2


async def test_too_many_requests_honours_retry_after(em, http, files, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="broker.providers.carbon")
    em.script = [Reply(429, headers={"Retry-After": "0.2"})]
    p = http(backoff_s=5.0, max_backoff_s=5.0)  # the backoff alone would wait seconds: Retry-After wins
    assert await p.latest("GB", SERVICE_NOW) == await files.latest("GB", SERVICE_NOW)
    assert em.count() == 2
    assert "HTTP 429 Too Many Requests; retry 1 of 3 in 0.20 s" in caplog.records[0].getMessage()


async def test_retry_after_is_capped(em, http, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="broker.providers.carbon")
    em.script = [Reply(503, headers={"Retry-After": "120"})]
    p = http(max_retry_after_s=0.05)
    await p.latest("GB", SERVICE_NOW)
    assert "HTTP 503 Service Unavailable; retry 1 of 3 in 0.05 s" in caplog.records[0].getMessage()


async def test_no_service_at_the_address(http) -> None:
    from tests.conftest import free_port

    p = http(base_url=f"http://127.0.0.1:{free_port()}", retries=1)
    with pytest.raises(ProviderError, match=r"zone GB: GET .*: cannot connect: .*; gave up after 2 attempts"):
        await p.latest("GB", SERVICE_NOW)


async def test_answers_that_make_no_sense_are_named(em, http) -> None:
    em.script = [Reply(200, body={"zone": "FR", "carbonIntensity": 1, "datetime": "2022-06-07T23:00:00Z"})]
    with pytest.raises(ProviderError, match="the answer is for zone 'FR', not 'GB'"):
        await http().latest("GB", SERVICE_NOW)
    em.script = [Reply(200, body={"zone": "GB", "data": [{"datetime": "2022-06-01T00:00:00Z", "carbonIntensity": -4}]})]
    with pytest.raises(ProviderError, match=r"entry 0 \(2022-06-01T00:00Z\): carbonIntensity -4 is not a number"):
        await http().history("GB", FIRST, END)
    em.script = [Reply(200, body={"zone": "GB"})]
    with pytest.raises(ProviderError, match="the answer has no 'data' list"):
        await http().history("GB", FIRST, END)
    # readings no grid gives: an integer too large for a float, and one that would make the forecast's sums inf
    for huge, shown in ((10 ** 400, "1000000000000000000000000000000000000..."), (1e308, "1e+308")):
        em.script = [Reply(200, body={"zone": "GB", "data": [{"datetime": "2022-06-01T00:00:00Z",
                                                               "carbonIntensity": huge}]})]
        with pytest.raises(ProviderError, match=rf"entry 0 \(2022-06-01T00:00Z\): carbonIntensity {re.escape(shown)} is "
                                                r"not a number from 0 to 5000 gCO2e/kWh"):
            await http().history("GB", FIRST, END)


# --- missing hours: interpolated up to 6 h inside the span, else an error ------------------------------------------


def stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.000Z")


async def test_short_gaps_are_interpolated(em, http, files) -> None:
    em.drop = {stamp(utc(2022, 6, 3, h)) for h in (10, 11, 12)}
    em.null = {stamp(utc(2022, 6, 5, 1))}
    got = await http().history("GB", FIRST, END)
    want = await files.history("GB", FIRST, END)
    i = 2 * 24 + 10  # 2022-06-03 10:00
    a, b = want[i - 1], want[i + 3]
    np.testing.assert_allclose(got[i: i + 3], [a + (b - a) * k / 4 for k in (1, 2, 3)])
    j = 4 * 24 + 1
    assert got[j] == pytest.approx((want[j - 1] + want[j + 1]) / 2)
    untouched = np.ones(len(want), bool)
    untouched[i: i + 3] = untouched[j] = False
    np.testing.assert_array_equal(got[untouched], want[untouched])


async def test_a_gap_is_named_with_the_request_that_should_have_had_it(em, http, monkeypatch, caplog) -> None:
    monkeypatch.setattr(carbon_module, "MAX_RANGE_HOURS", 72)  # three requests for the week
    em.drop = {stamp(utc(2022, 6, 2, h)) for h in range(3, 11)}  # in the first request's hours
    with pytest.raises(ProviderError, match=r"past-range\?zone=GB&start=2022-06-01T00:00:00Z&end=2022-06-04T00:00:00Z: "
                                            r"the service has no data for the 8 h from 2022-06-02T03:00Z"):
        await http().history("GB", FIRST, END)
    em.drop = {stamp(utc(2022, 6, 5, 3))}  # in the second's: filled, and the log names it
    with caplog.at_level(logging.INFO, logger="broker.providers.carbon"):
        await http().history("GB", FIRST, END)
    assert ("interpolated missing hours: 1 h from 2022-06-05T03:00Z to 2022-06-05T04:00Z (GET /v3/carbon-intensity/"
            "past-range?zone=GB&start=2022-06-04T00:00:00Z&end=2022-06-07T00:00:00Z)") in caplog.text


async def test_long_gaps_and_gaps_at_the_ends_are_errors(em, http) -> None:
    em.drop = {stamp(utc(2022, 6, 3, h)) for h in range(10, 17)}
    with pytest.raises(ProviderError, match=r"zone GB: GET /v3/carbon-intensity/past-range\?zone=GB&.*: the service "
                                            r"has no data for the 7 h from 2022-06-03T10:00Z to 2022-06-03T17:00Z, "
                                            r"longer than the 6 h that are interpolated"):
        await http().history("GB", FIRST, END)
    em.drop = {stamp(FIRST)}
    with pytest.raises(ProviderError, match=r"no data for the 1 h from 2022-06-01T00:00Z to 2022-06-01T01:00Z, at the "
                                            r"start of the span asked for"):
        await http().history("GB", FIRST, END)
    with pytest.raises(ProviderError, match=r"no data for the 24 h from 2022-06-08T00:00Z .* at the end"):
        await http().history("GB", END - 24 * H, END + 24 * H)  # the service has nothing after the recordings


# --- the file provider ----------------------------------------------------------------------------------------------


async def test_file_provider_answers_from_the_files(files) -> None:
    assert isinstance(files, CarbonProvider)
    got = await files.history("GB", FIRST, FIRST + 3 * H)
    np.testing.assert_array_equal(got, [243.75, 246.74, files.data.intensity("GB", FIRST + 2 * H)])
    got[0] = 0  # a copy: the data is untouched
    assert files.data.intensity("GB", FIRST) == 243.75
    assert await files.latest("uk", FIRST + timedelta(minutes=59)) == 243.75
    await files.close()


async def test_file_provider_outside_the_data_names_zone_and_span(files) -> None:
    covered = "which covers 2022-06-01T00:00Z to 2022-06-22T00:00Z"
    with pytest.raises(ProviderError, match=rf"^carbon provider: zone DE-LU: files .*data/carbon: 2022-06-21T00:00Z "
                                            rf"to 2022-06-23T00:00Z is outside the data, {covered}$"):
        await files.history("DE", utc(2022, 6, 21), utc(2022, 6, 23))
    with pytest.raises(ProviderError,
                       match=rf"zone GB: files .*: 2022-05-31T23:59:00\+00:00 is outside the data, {covered}"):
        await files.latest("GB", utc(2022, 5, 31, 23, 59))
    with pytest.raises(ProviderError, match=r"zone FR: files .*: no carbon data for this zone; zones loaded: AU-NSW, "):
        await files.latest("FR", FIRST)
    with pytest.raises(ValueError, match="now must be timezone-aware"):
        await files.latest("GB", datetime(2022, 6, 2))


# --- configuration ---------------------------------------------------------------------------------------------------


async def test_config_of_both_kinds() -> None:
    f = parse_carbon_provider_config({"kind": "files", "path": "data/carbon"})
    assert isinstance(f, FilesCarbonConfig) and f.path == "data/carbon" and f.lifecycle is False
    h = parse_carbon_provider_config({"kind": "http", "url": "https://api.electricitymap.org", "token_env": "EM_TOKEN",
                                      "timeout_s": 2, "cache_ttl_s": 60, "retries": 1, "zones": {"germany": "DE"}})
    assert isinstance(h, HttpCarbonConfig)
    assert (h.token_env, h.timeout_s, h.cache_ttl_s, h.retries, h.zones) == ("EM_TOKEN", 2, 60, 1, {"DE-LU": "DE"})
    d = parse_carbon_provider_config({"kind": "http", "url": "http://127.0.0.1:9"})
    assert (d.token_env, d.timeout_s, d.cache_ttl_s, d.retries) == (None, 5.0, 300.0, 3)


@pytest.mark.parametrize(("data", "problem"), [
    ({"kind": "ftp", "path": "x"}, "does not match any of the expected tags: 'files', 'http'"),
    ({"path": "data/carbon"}, "Unable to extract tag using discriminator 'kind'"),
    ({"kind": "files", "path": "x", "url": "http://a"}, "Extra inputs are not permitted"),
    ({"kind": "http", "url": "not a url"}, "url\n  Input should be a valid URL"),
    ({"kind": "http", "url": "http://a", "token_env": "MY TOKEN"}, "token_env\n  String should match pattern"),
    ({"kind": "http", "url": "http://a", "retries": -1}, "retries\n  Input should be greater than or equal to 0"),
])
async def test_bad_config_is_a_clear_pydantic_error(data, problem) -> None:
    with pytest.raises(ValidationError, match=problem):
        parse_carbon_provider_config(data)


async def test_build_carbon_provider(em, files) -> None:
    f = build_carbon_provider({"kind": "files", "path": str(ROOT / "data" / "carbon")})
    assert isinstance(f, FileCarbonProvider) and await f.latest("GB", FIRST) == 243.75
    em.token = TOKEN
    cfg = {"kind": "http", "url": em.url, "token_env": "EM_TOKEN", "timeout_s": 1}
    p = build_carbon_provider(cfg, clock=ManualClock(SERVICE_NOW), environ={"EM_TOKEN": TOKEN})
    try:
        assert isinstance(p, HttpCarbonProvider) and isinstance(p, CarbonProvider)
        assert await p.latest("GB", SERVICE_NOW) == await files.latest("GB", SERVICE_NOW)
    finally:
        await p.close()
    with pytest.raises(ProviderError, match=r"^carbon provider: token_env names \$EM_TOKEN, which is not set"):
        build_carbon_provider(cfg, environ={})


async def test_http_provider_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="must look like https://HOST"):
        HttpCarbonProvider("api.electricitymap.org")
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        HttpCarbonProvider("http://a", timeout_s=0)
    with pytest.raises(ValueError, match="retries must be a whole number of 0 or more"):
        HttpCarbonProvider("http://a", retries=-1)


# --- prices -----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def price_list() -> FilePriceProvider:
    return FilePriceProvider(load_gcp_prices(PRICES))


def test_static_prices_are_the_site_spec() -> None:
    s = site("london", region="gcp:europe-west2", grid_zone="GB", gpus={"l4": 8}, usd_per_gpu_hour={"l4": 0.9})
    p = StaticPriceProvider()
    assert p.usd_per_gpu_hour(s, "nvidia-l4") == 0.9
    assert p.usd_per_gpu_hour(s, "l4", spot=True) == 0.9
    assert p.usd_per_gpu_hour(s, "a100-80gb") is None
    assert (p.source(s, "l4"), p.source(s, "a100-80gb")) == ("site spec", "none")


def test_the_price_list_overrides_the_site_spec_and_says_so(price_list) -> None:
    s = site("london", region="gcp:europe-west2", grid_zone="GB", gpus={"l4": 8, "a100-40gb": 8},
             usd_per_gpu_hour={"l4": 0.9, "a100-40gb": 99.0})
    table = price_list.table
    assert price_list.usd_per_gpu_hour(s, "a100") == table.price("gcp:europe-west2", "a100-40gb") != 99.0
    assert price_list.usd_per_gpu_hour(s, "a100", spot=True) == table.price("gcp:europe-west2", "a100-40gb", spot=True)
    machine = table.entry("gcp:europe-west2", "a100-40gb").instance_type
    assert price_list.source(s, "a100") == f"price list {PRICES} (gcp:europe-west2, {machine}, on-demand)"
    assert price_list.source(s, "a100", spot=True).endswith(", spot)")


def test_the_price_list_falls_back_to_the_site_spec(price_list) -> None:
    onprem = site("lab", region="onprem:basement", grid_zone="GB", gpus={"l4": 8}, usd_per_gpu_hour={"l4": 0.5})
    assert price_list.usd_per_gpu_hour(onprem, "l4") == 0.5
    assert price_list.source(onprem, "l4") == "site spec"
    bare = site("bare", region="onprem:basement", grid_zone="GB", gpus={"l4": 8})
    assert price_list.usd_per_gpu_hour(bare, "l4") is None and price_list.source(bare, "l4") == "none"


def test_price_provider_config() -> None:
    assert isinstance(build_price_provider(), StaticPriceProvider)
    assert isinstance(build_price_provider({"kind": "static"}), StaticPriceProvider)
    p = build_price_provider({"kind": "files", "path": str(PRICES)})
    assert isinstance(p, FilePriceProvider) and p.table.regions
    with pytest.raises(ValidationError, match="does not match any of the expected tags: 'static', 'files'"):
        parse_price_provider_config({"kind": "live"})
