"""GPU telemetry from NVIDIA's DCGM exporter (dcgm-exporter, part of the GPU Operator), read through the
Prometheus server that scrapes it: one :class:`PrometheusSource` reading per call, for a
:class:`adapters.telemetry.TelemetryFeed`.

What is read, per GPU series (dcgm-exporter's labels ``gpu``, ``UUID``/``uuid``, ``Hostname``, ``modelName``,
and ``GPU_I_ID`` on a MIG instance), with Prometheus's HTTP API (``GET {url}/api/v1/query``, an instant query
of ``METRIC{selector}``):

- ``DCGM_FI_DEV_GPU_TEMP`` (°C), ``DCGM_FI_DEV_POWER_USAGE`` (W), ``DCGM_FI_DEV_GPU_UTIL`` (%);
- ``DCGM_FI_DEV_FB_USED`` and ``DCGM_FI_DEV_FB_FREE`` (MiB; GiB once read; a GPU's total is used + free,
  counted where both are there);
- the clock-event reasons bitmask, ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` (DCGM 3.3 and later), or where that
  has no series ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` (its earlier name). Its bits are NVML's, decoded with
  the names ``adapters.nvml`` gives them (``hw_thermal``, ``sw_power_cap``, ...). dcgm-exporter's default
  counters leave it out: without it ``throttled_pct`` stays unset (the README says which line to add).

The GPUs are folded as ``adapters.nvml`` folds a node's (:func:`adapters.nvml.telemetry_of`): mean
utilisation, summed memory and power, the hottest GPU, and the share of GPUs held down by heat or power.
A GPU is one physical GPU (its UUID, else its host and ``gpu`` index): series that repeat it (one per MIG
instance, or the same GPU scraped twice) count once, with the highest reading and every clock-event reason
any of them gives; its memory is its own series, or where it has none the sum of its MIG instances'.

Each metric is its own query, and the seven go concurrently (``asyncio.gather``): a reading takes one round
trip, and an error names the metric it is about. Answers are parsed and folded in worker threads, so a large
cluster's megabytes of JSON never stall the event loop, and an answer over ``MAX_ANSWER_BYTES`` (64 MiB) fails
the reading (the selector should narrow it to the site's GPUs). One query for all of them (``{__name__=~"..."}``) would
save six requests a reading but give one error for all, and its answer would have to be split by name anyway.

Failures (:class:`PrometheusError`, which names the metric; the feed logs it and keeps the last reading):
a query Prometheus answers with an error status or HTTP 4xx (never retried), a body that is not Prometheus's
JSON, no answer within ``timeout_s`` (not retried: the next reading comes in ``every_s``), a value that is
NaN, infinite or out of range for its unit (a misreading exporter: the whole reading is refused rather than
a GPU quietly dropped), or no GPU series at all (the selector matches nothing, or nothing scrapes the
exporter). Connection errors and HTTP 429/5xx are retried (``ATTEMPTS`` in all, ``BACKOFF_S`` doubling). A
series without a value, with one that is not a number, or with one of DCGM's "no value" sentinels (which
dcgm-exporter passes on for a field a GPU does not support, e.g. 9223372036854775794) is skipped: that GPU
does not report that metric (logged once per metric).

Credentials: ``token_env`` names the environment variable holding a bearer token, read when the source is
built (a variable that is unset or empty fails each reading, with its name); ``ca_file`` verifies an https
server with a private CA. Neither the token nor the URL's credentials (refused in the config) are logged.

Turning it off: leave ``telemetry`` unset (the agent's config, or a Kubernetes site's adapter). To look at
what a site would read: ``python -m adapters.dcgm http://prometheus:9090 --selector 'cluster="lon-1"'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import ssl
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_exponential

from adapters.nvml import GpuSample, clock_event_bits, decode_reasons, telemetry_of
from broker import ids
from broker.errors import problems
from broker.models import MAX_GPU_MEMORY_GIB, PrometheusTelemetryConfig, Telemetry

log = logging.getLogger(__name__)

ATTEMPTS = 3  # per query, on connection errors and HTTP 429/5xx
MAX_ANSWER_BYTES = 64 << 20  # per query: about 150,000 GPU series with dcgm-exporter's usual labels
BACKOFF_S = 0.2  # the first wait between them; doubling
_MIB_PER_GIB = 1024.0


@dataclass(frozen=True, slots=True)
class Metric:
    """A DCGM field as dcgm-exporter names it, its unit and the values it can take."""

    name: str
    unit: str
    low: float
    high: float


TEMPERATURE = Metric("DCGM_FI_DEV_GPU_TEMP", "°C", -40.0, 200.0)
POWER = Metric("DCGM_FI_DEV_POWER_USAGE", "W", 0.0, 5000.0)
UTILISATION = Metric("DCGM_FI_DEV_GPU_UTIL", "%", 0.0, 100.0)
FB_USED = Metric("DCGM_FI_DEV_FB_USED", "MiB", 0.0, MAX_GPU_MEMORY_GIB * _MIB_PER_GIB)
FB_FREE = Metric("DCGM_FI_DEV_FB_FREE", "MiB", 0.0, MAX_GPU_MEMORY_GIB * _MIB_PER_GIB)
# NVML defines bits up to 0x400; DCGM's "no value" sentinels (``_dcgm_blank``) are far above.
REASONS = Metric("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "bitmask", 0, 0xFFFFFF)
REASONS_BEFORE_DCGM_3_3 = Metric("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "bitmask", 0, 0xFFFFFF)
METRICS = (TEMPERATURE, POWER, UTILISATION, FB_USED, FB_FREE, REASONS, REASONS_BEFORE_DCGM_3_3)

GpuKey = tuple[str, ...]  # ("uuid", UUID) or ("host", Hostname or instance, gpu index)


class PrometheusError(RuntimeError):
    """A reading from Prometheus failed; the message names the metric and what to check."""


class _Transient(Exception):
    """A failure worth another try: no connection, HTTP 429 or 5xx."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Series:
    """One series of an instant query's answer: its GPU, MIG instance (None: the GPU itself) and value."""

    gpu: GpuKey
    instance: str | None
    labels: Mapping[str, str]
    value: float


class PrometheusSource:
    """Reads the GPUs a Prometheus server has from dcgm-exporter (see the module's docstring). One
    ``aiohttp.ClientSession``, made at the first reading (in the event loop) and closed by :meth:`aclose`."""

    def __init__(self, config: PrometheusTelemetryConfig, *, environ: Mapping[str, str] | None = None,
                 attempts: int = ATTEMPTS, backoff_s: float = BACKOFF_S) -> None:
        self.config = config
        self.query_url = config.url + "/api/v1/query"
        env = os.environ if environ is None else environ
        self._token = env.get(config.token_env, "").strip() if config.token_env else None
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._session: aiohttp.ClientSession | None = None
        self._skipped_logged: set[str] = set()
        self.gpus: tuple[GpuSample, ...] = ()  # the GPUs of the latest reading

    def query(self, metric: Metric) -> str:
        """The PromQL of ``metric``: its name with the configured selector."""
        return f"{metric.name}{{{self.config.selector}}}" if self.config.selector else metric.name

    async def read(self) -> Telemetry:
        if self.config.token_env is not None and not self._token:
            raise PrometheusError(f"token_env names ${self.config.token_env}, which is not set (or empty) in this "
                                  "process's environment: set it to Prometheus's bearer token, or drop token_env")
        answers = await asyncio.gather(*(self._series(m) for m in METRICS), return_exceptions=True)
        found: dict[Metric, list[Series]] = {}
        for metric, answer in zip(METRICS, answers, strict=True):
            if isinstance(answer, BaseException):
                raise answer  # the first failure (every query has ended: each is bounded by timeout_s)
            found[metric] = answer
        reasons = found[REASONS] or found[REASONS_BEFORE_DCGM_3_3]
        self.gpus = await asyncio.to_thread(self._fold_series, found, reasons)
        if not self.gpus:
            raise PrometheusError(
                f"no GPU series: {self.query(TEMPERATURE)} and the other DCGM metrics match nothing at "
                f"{self.config.url}; check that this Prometheus scrapes dcgm-exporter and that the selector "
                "matches its labels")
        return await asyncio.to_thread(telemetry_of, self.gpus)

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    # --- folding ---

    @staticmethod
    def _fold_series(found: dict[Metric, list[Series]], reasons: list[Series]) -> tuple[GpuSample, ...]:
        labels: dict[GpuKey, Mapping[str, str]] = {}
        for series in found.values():
            for s in series:
                labels.setdefault(s.gpu, s.labels)
        bits = clock_event_bits()

        def highest(metric: Metric) -> dict[GpuKey, float]:
            out: dict[GpuKey, float] = {}
            for s in found[metric]:
                out[s.gpu] = max(out.get(s.gpu, -math.inf), s.value)
            return out

        def memory(metric: Metric) -> dict[GpuKey, float]:
            own = {s.gpu: s.value for s in found[metric] if s.instance is None}
            slices: dict[GpuKey, dict[str, float]] = {}
            for s in found[metric]:
                if s.instance is not None:
                    slices.setdefault(s.gpu, {})[s.instance] = s.value
            return {gpu: own[gpu] if gpu in own else sum(slices[gpu].values()) for gpu in {*own, *slices}}

        masks: dict[GpuKey, int] = {}
        for s in reasons:
            masks[s.gpu] = masks.get(s.gpu, 0) | int(s.value)
        temps, power, util = highest(TEMPERATURE), highest(POWER), highest(UTILISATION)
        used, free = memory(FB_USED), memory(FB_FREE)
        gpus = []
        for key in sorted(labels):
            lab = labels[key]
            name = lab.get("modelName", "")
            both = key in used and key in free
            gpus.append(GpuSample(
                index=_int(lab.get("gpu")),
                uuid=lab.get("UUID") or lab.get("uuid") or "",
                name=name,
                model=_model(name),
                utilisation_pct=util.get(key),
                memory_used_gib=used[key] / _MIB_PER_GIB if both else None,
                memory_total_gib=(used[key] + free[key]) / _MIB_PER_GIB if both else None,
                temperature_c=temps.get(key),
                power_w=power.get(key),
                power_limit_w=None,
                throttle_reasons=decode_reasons(masks[key], bits) if key in masks else None,
                mig_enabled=None,
            ))
        return tuple(gpus)

    # --- one query ---

    async def _series(self, metric: Metric) -> list[Series]:
        what, body = await self._query(metric)
        # Parsed in a worker thread: a large cluster's answer (megabytes of JSON) would stall the event loop.
        return await asyncio.to_thread(self._parse, metric, what, body)

    def _parse(self, metric: Metric, what: str, body: bytes) -> list[Series]:
        result = self._vector(metric, what, body)
        out: list[Series] = []
        skipped = 0
        for item in result:
            labels = item.get("metric") if isinstance(item, dict) else None
            value = item.get("value") if isinstance(item, dict) else None
            if not isinstance(labels, dict) or not isinstance(value, list) or len(value) != 2:
                skipped += 1
                continue
            labels = {str(k): str(v) for k, v in labels.items()}
            number = _number(value[1])
            if number is None or _dcgm_blank(number):
                skipped += 1
                continue
            gpu = _gpu_key(labels)
            if not math.isfinite(number):
                raise PrometheusError(f"{metric.name} is {value[1]} for {_gpu_text(gpu)}: not a number; check "
                                      "dcgm-exporter on that node")
            if metric.unit == "bitmask" and not (number.is_integer() and metric.low <= number <= metric.high):
                raise PrometheusError(
                    f"{metric.name} is {value[1]} for {_gpu_text(gpu)}: not a clock-event reasons bitmask (a whole "
                    f"number from 0 to {int(metric.high):#x}): check dcgm-exporter on that node (or whatever else "
                    "writes this metric)")
            if not metric.low <= number <= metric.high:
                raise PrometheusError(
                    f"{metric.name} is {value[1]} {metric.unit} for {_gpu_text(gpu)}, outside {metric.low:.0f} to "
                    f"{metric.high:.0f} {metric.unit}: check dcgm-exporter on that node (or whatever else writes "
                    "this metric)")
            out.append(Series(gpu, labels.get("GPU_I_ID") or None, labels, number))
        if skipped:
            level = logging.WARNING if metric.name not in self._skipped_logged else logging.DEBUG
            self._skipped_logged.add(metric.name)
            log.log(level, "Prometheus %s: %s: %d series without a value (none, not a number, or DCGM's blank) "
                           "skipped", self.config.url, metric.name, skipped)
        return out

    async def _query(self, metric: Metric) -> tuple[str, bytes]:
        """The HTTP status line and body of an instant query of ``metric`` that Prometheus answered with a
        success status, retried on transient failures."""
        attempts = 0
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(self._attempts),
                wait=wait_exponential(multiplier=self._backoff_s, max=self._backoff_s * 8),
                retry=retry_if_exception_type(_Transient),
                before_sleep=lambda rs: self._log_retry(metric, rs),
                reraise=True,
            ):
                with attempt:
                    attempts = attempt.retry_state.attempt_number
                    return await self._once(metric)
        except _Transient as e:
            raise PrometheusError(f"{metric.name}: {e.reason}; gave up after {attempts} attempt"
                                  f"{'s' if attempts != 1 else ''}") from None
        raise AssertionError("not reached")  # pragma: no cover

    def _log_retry(self, metric: Metric, rs: RetryCallState) -> None:
        exc = rs.outcome.exception() if rs.outcome is not None else None
        wait = rs.next_action.sleep if rs.next_action is not None else 0.0
        log.debug("Prometheus %s: %s: %s; retry %d of %d in %.2f s", self.config.url, metric.name,
                  getattr(exc, "reason", exc), rs.attempt_number, self._attempts - 1, wait)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_context: ssl.SSLContext | None = None
            if self.config.ca_file is not None:
                try:
                    ssl_context = ssl.create_default_context(cafile=self.config.ca_file)
                except (OSError, ssl.SSLError) as e:
                    raise PrometheusError(f"ca_file {self.config.ca_file} cannot be read as a PEM CA bundle: "
                                          f"{e}") from None
            headers = {"Accept": "application/json"}
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s), headers=headers,
                connector=aiohttp.TCPConnector(ssl=ssl_context) if ssl_context is not None else None)
        return self._session

    async def _once(self, metric: Metric) -> tuple[str, bytes]:
        where = f"{metric.name}: {self.query_url}"
        try:
            async with self._http().get(self.query_url, params={"query": self.query(metric)}) as resp:
                status, reason = resp.status, resp.reason or ""
                body = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > MAX_ANSWER_BYTES:
                        raise PrometheusError(
                            f"{where}: the answer is over {MAX_ANSWER_BYTES >> 20} MiB; narrow the selector to "
                            "this site's GPUs")
                body = bytes(body)
        except TimeoutError:
            raise PrometheusError(f"{where}: no answer within {self.config.timeout_s:g} s (timeout_s)") from None
        except aiohttp.ClientConnectionError as e:
            raise _Transient(f"cannot connect to {self.query_url}: {e or type(e).__name__}") from None
        except aiohttp.ClientPayloadError as e:
            raise _Transient(f"the answer from {self.query_url} was cut off: {e or type(e).__name__}") from None
        except aiohttp.ClientError as e:
            raise PrometheusError(f"{where}: request failed: {e or type(e).__name__}") from None
        what = f"HTTP {status} {reason}".rstrip()
        if status == 429 or status >= 500:
            raise _Transient(f"{self.query_url} answered {what}: {_message(body)}")
        if status in (401, 403):
            hint = (f"check the token in ${self.config.token_env}" if self.config.token_env
                    else "it wants a bearer token: name the environment variable that holds it in token_env")
            raise PrometheusError(f"{where}: {what}: Prometheus refused the query; {hint}")
        if status == 404:
            raise PrometheusError(f"{where}: {what}: is url the Prometheus server's base URL (its API is at "
                                  "/api/v1)?")
        if status >= 400:
            raise PrometheusError(f"{where}: {what}: {_message(body)} (query: {self.query(metric)})")
        return what, body

    def _vector(self, metric: Metric, what: str, body: bytes) -> list[Any]:
        """The ``result`` list of an instant query's answer; PrometheusError for anything else."""
        where = f"{metric.name}: {self.query_url}"
        try:
            data = json.loads(body)
        except ValueError:
            excerpt = body[:80].decode("utf-8", "replace")
            raise PrometheusError(f"{where}: {what}, but the answer is not JSON: {excerpt!r}; is url the "
                                  "Prometheus server (its API is at /api/v1)?") from None
        if not isinstance(data, dict) or data.get("status") != "success":
            error = data.get("error") if isinstance(data, dict) else None
            raise PrometheusError(f"{where}: Prometheus answered {_short(error or data)} "
                                  f"(query: {self.query(metric)})")
        result = data.get("data")
        if not isinstance(result, dict) or result.get("resultType") != "vector" \
                or not isinstance(result.get("result"), list):
            raise PrometheusError(f"{where}: the answer is not an instant vector: {_short(result)}")
        return result["result"]


# --- helpers ---------------------------------------------------------------------------------------------


def _gpu_key(labels: Mapping[str, str]) -> GpuKey:
    uuid = labels.get("UUID") or labels.get("uuid")
    if uuid:
        return ("uuid", uuid)
    return ("host", labels.get("Hostname") or labels.get("instance") or "", labels.get("gpu", ""))


def _gpu_text(key: GpuKey) -> str:
    return f"GPU {key[1]}" if key[0] == "uuid" else f"GPU {key[2] or '?'} of {key[1] or 'an unnamed host'}"


def _number(raw: Any) -> float | None:
    """A sample's value (Prometheus sends a string: "83", "NaN", "+Inf"); None when it is not a number."""
    if not isinstance(raw, str):
        return None
    try:
        return float(raw)
    except ValueError:
        return None


def _dcgm_blank(number: float) -> bool:
    """Whether ``number`` is one of DCGM's "no value" sentinels (blank, not found, not supported, no permission),
    which dcgm-exporter passes on for a field a GPU does not report: DCGM_INT32_BLANK (0x7ffffff0) and the three
    after it, DCGM_INT64_BLANK (0x7ffffffffffffff0, 2**63 once a float) and after, DCGM_FP64_BLANK (2**47)
    and after."""
    return 0x7FFFFFF0 <= number <= 0x7FFFFFF3 or 2.0**47 <= number <= 2.0**47 + 3 or number == 2.0**63


def _int(raw: str | None) -> int:
    try:
        return int(raw) if raw is not None else -1
    except ValueError:
        return -1


def _model(name: str) -> str | None:
    try:
        return ids.gpu_model(name) if name else None
    except ids.UnknownIdentifier:
        return None


def _message(body: bytes) -> str:
    """Prometheus's own words about an error (``{"error": ...}``), or the body's start."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        text = data["error"]
    return _short(text) or "no message"


def _short(value: Any) -> str:
    text = " ".join(str(value).split())
    return text[:200] + "..." if len(text) > 200 else text


# --- command line ----------------------------------------------------------------------------------------


async def _cli(config: PrometheusTelemetryConfig) -> int:
    source = PrometheusSource(config)
    try:
        telemetry = await source.read()
    except PrometheusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        await source.aclose()
    for g in source.gpus:
        reasons = "n/a" if g.throttle_reasons is None else (",".join(g.throttle_reasons) or "none")
        print(f"{g.uuid or g.index} {g.name}: util {g.utilisation_pct}%  temp {g.temperature_c} °C  "
              f"power {g.power_w} W  memory {g.memory_used_gib}/{g.memory_total_gib} GiB  clocks {reasons}")
    print(json.dumps(telemetry.model_dump(mode="json")))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adapters.dcgm",
                                     description="Print the GPU telemetry a site would read from Prometheus.")
    parser.add_argument("url", help="the Prometheus server's base URL")
    parser.add_argument("--selector", default="", help='PromQL label matchers, e.g. cluster="lon-1"')
    parser.add_argument("--token-env", default=None, help="environment variable holding a bearer token")
    parser.add_argument("--ca-file", default=None, help="CA bundle (PEM) for an https server")
    args = parser.parse_args(argv)
    try:
        config = PrometheusTelemetryConfig(url=args.url, selector=args.selector, token_env=args.token_env,
                                           ca_file=args.ca_file)
    except ValidationError as e:
        parser.error("; ".join(f"{d['field']}: {d['problem']}" for d in problems(e)))
    return asyncio.run(_cli(config))


if __name__ == "__main__":
    sys.exit(main())
