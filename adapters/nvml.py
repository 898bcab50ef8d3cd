"""GPU telemetry from NVML (the ``nvidia-ml-py`` bindings, module ``pynvml``), one sample per call.

- :class:`NvmlCollector` reads, per GPU: utilisation (%), memory used and total (GiB), temperature (°C),
  power draw and enforced power limit (W), the reasons its clocks are held down right now (short names such
  as ``sw_power_cap``, ``hw_thermal``, ``idle``), and MIG mode with each MIG device's memory (GiB) and
  profile (``1g.10gb``). The NVML module is injected (default: ``import pynvml`` at :meth:`open`), so tests
  use a fake at exactly that boundary.
- A metric a GPU does not support (``NVMLError_NotSupported``, or a function this driver lacks) is ``None``,
  never a crash. A GPU this process may not use (``NVMLError_NoPermission``: ``nvmlDeviceGetCount`` counts
  those too) or that has fallen off the bus (``NVMLError_GpuIsLost``) is left out of the sample, named in
  ``NodeSample.left_out`` and logged once; the other GPUs are still reported. Any other NVML error fails the
  whole sample, so nothing is silently wrong.
- No driver: :meth:`NvmlCollector.open` raises :class:`NvmlUnavailable` with a one-line message that names
  the cause and what to do.
- :meth:`NodeSample.telemetry` folds the GPUs into :class:`broker.models.Telemetry` (mean utilisation,
  summed memory and power, hottest GPU), for an adapter's ``SiteState`` (:func:`telemetry_of`, which
  ``adapters.dcgm`` uses too).
- :func:`run_sampler` samples every ``every_s`` seconds of the injected clock, in a worker thread so the
  event loop never blocks; a sample that raises is logged and skipped.

Turning it off: nothing samples unless an adapter starts :func:`run_sampler`; without it a site reports
the default (zero) telemetry. To look at a machine by hand: ``python -m adapters.nvml --every 1 --count 5``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from types import ModuleType
from typing import Any, Protocol

from broker import ids
from broker.clock import Clock, SystemClock
from broker.models import Telemetry

log = logging.getLogger(__name__)

_BYTES_PER_GIB = 1024**3
_MW_PER_W = 1000.0

# Clock-event bits by the suffix of their pynvml constant (nvmlClocksEventReason*, or the older
# nvmlClocksThrottleReason*). Suffixes not listed here still decode, as their snake_case name.
_REASON_NAMES: dict[str, str] = {
    "GpuIdle": "idle",
    "ApplicationsClocksSetting": "applications_clocks",
    "SwPowerCap": "sw_power_cap",
    "HwSlowdown": "hw_slowdown",
    "SyncBoost": "sync_boost",
    "SwThermalSlowdown": "sw_thermal",
    "HwThermalSlowdown": "hw_thermal",
    "HwPowerBrakeSlowdown": "power_brake",
    "DisplayClockSetting": "display_clock",
    "BoardLimit": "board_limit",
    "Reliability": "reliability",
}
_REASON_PREFIXES = ("nvmlClocksEventReason", "nvmlClocksThrottleReason")
_REASON_NOT_BITS = {"None", "All", "UserDefinedClocks"}  # no bit, every bit, an alias of another bit
_MIG_PROFILE = re.compile(r"\bMIG\s+(\S+)\s*$")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine (no driver, driver not loaded, bindings missing)."""


# --- samples ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MigSample:
    """One MIG device of a GPU in MIG mode. ``slot`` is its index under the parent GPU."""

    slot: int
    uuid: str
    name: str
    profile: str | None  # "1g.10gb", from the device name; None when the name does not carry it
    gpu_instance_id: int | None
    compute_instance_id: int | None
    memory_used_gib: float | None
    memory_total_gib: float | None


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One physical GPU at one instant. ``None``: the GPU does not report that metric."""

    index: int
    uuid: str
    name: str  # as NVML reports it: "NVIDIA A100-SXM4-80GB"
    model: str | None  # canonical id (broker.ids): "a100-80gb"; None for a model heliotrope does not know
    utilisation_pct: float | None  # share of the last sample period a kernel ran; not reported in MIG mode
    memory_used_gib: float | None
    memory_total_gib: float | None
    temperature_c: float | None
    power_w: float | None
    power_limit_w: float | None
    throttle_reasons: tuple[str, ...] | None  # () when clocks run free
    mig_enabled: bool | None  # None: the GPU has no MIG
    mig_devices: tuple[MigSample, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeSample:
    """Every GPU of one node at one instant (UTC)."""

    taken_at: datetime
    driver_version: str | None
    gpus: tuple[GpuSample, ...]
    left_out: tuple[str, ...] = ()  # GPUs not read, with why: "GPU 1: no permission (NVMLError_NoPermission)"

    def telemetry(self) -> Telemetry:
        """Node-wide telemetry (:func:`telemetry_of` its GPUs)."""
        return telemetry_of(self.gpus)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["taken_at"] = self.taken_at.isoformat()
        return out


def telemetry_of(gpus: Iterable[GpuSample]) -> Telemetry:
    """The telemetry of ``gpus`` (one node's, or a cluster's as ``adapters.dcgm`` reads them): mean utilisation
    over the GPUs that report it, summed memory and power, the hottest GPU's temperature, and the share of GPUs
    whose clocks heat or power holds down (over the GPUs whose clock-event reasons could be read; unset when
    none could). A metric no GPU reports counts as 0."""
    gpus = tuple(gpus)
    util = [g.utilisation_pct for g in gpus if g.utilisation_pct is not None]
    temps = [g.temperature_c for g in gpus if g.temperature_c is not None]
    return Telemetry(
        gpu_utilisation_pct=min(100.0, max(0.0, sum(util) / len(util))) if util else 0.0,
        memory_used_gib=sum(g.memory_used_gib or 0.0 for g in gpus),
        memory_total_gib=sum(g.memory_total_gib or 0.0 for g in gpus),
        temperature_c_max=max(temps) if temps else 0.0,
        power_w=sum(g.power_w or 0.0 for g in gpus),
        **Telemetry.throttle_of([g.throttle_reasons for g in gpus if g.throttle_reasons is not None]),
    )


# --- collector ----------------------------------------------------------------------------------------


class NvmlCollector:
    """Reads every GPU of this node through NVML. ``open()`` before ``sample()``, ``close()`` after
    (or use it as a context manager). Safe to call ``sample()`` from a worker thread."""

    def __init__(self, nvml: ModuleType | Any | None = None, clock: Clock | None = None) -> None:
        self._nvml = nvml
        self._clock = clock or SystemClock()
        self._open = False
        self._reason_bits: dict[int, str] = {}
        self._warned: set[tuple[int, str]] = set()  # (GPU index, error) already logged

    def __enter__(self) -> NvmlCollector:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Start NVML. Raises :class:`NvmlUnavailable` with the cause when this machine cannot."""
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable(
                    "the NVML bindings are not installed (pip install nvidia-ml-py); "
                    "this machine cannot report GPU telemetry"
                ) from exc
            self._nvml = pynvml
        nv = self._nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError_LibraryNotFound as exc:
            raise NvmlUnavailable(
                "no NVIDIA driver: libnvidia-ml.so.1 not found; this machine cannot report GPU telemetry"
            ) from exc
        except nv.NVMLError_DriverNotLoaded as exc:
            raise NvmlUnavailable(
                "NVIDIA driver not loaded: libnvidia-ml.so.1 is installed but the kernel driver is not running "
                "(check nvidia-smi and `lsmod | grep nvidia`); this machine cannot report GPU telemetry"
            ) from exc
        except nv.NVMLError as exc:
            raise NvmlUnavailable(
                f"NVML failed to start: {exc} ({type(exc).__name__}); this machine cannot report GPU telemetry"
            ) from exc
        self._open = True
        self._reason_bits = _reason_bits(nv)

    def close(self) -> None:
        """Stop NVML (the library stays loaded; a later ``open()`` starts it again)."""
        if self._open:
            self._open = False
            self._nvml.nvmlShutdown()

    def sample(self) -> NodeSample:
        """Read every GPU once. A GPU this process may not use, or that is lost, is left out (``left_out``,
        logged once); any other ``NVMLError`` but an unsupported metric is raised."""
        if not self._open:
            raise RuntimeError("NvmlCollector.sample() called before open()")
        nv = self._nvml
        taken_at = self._clock.now()
        driver = self._optional(nv.nvmlSystemGetDriverVersion)
        gpus: list[GpuSample] = []
        left_out: list[str] = []
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                gpus.append(self._gpu(i, nv.nvmlDeviceGetHandleByIndex(i)))
            except (nv.NVMLError_NoPermission, nv.NVMLError_GpuIsLost) as exc:
                why = "no permission" if isinstance(exc, nv.NVMLError_NoPermission) else "lost (fallen off the bus)"
                left_out.append(f"GPU {i}: {why} ({type(exc).__name__})")
                if (i, type(exc).__name__) not in self._warned:
                    self._warned.add((i, type(exc).__name__))
                    log.warning("NVML: GPU %d cannot be read, %s (%s); left out of the telemetry, the other GPUs "
                                "are still reported", i, why, type(exc).__name__)
        return NodeSample(taken_at=taken_at, driver_version=driver, gpus=tuple(gpus), left_out=tuple(left_out))

    # --- one GPU ---

    def _gpu(self, index: int, handle: Any) -> GpuSample:
        nv = self._nvml
        name = nv.nvmlDeviceGetName(handle)
        util = self._optional(nv.nvmlDeviceGetUtilizationRates, handle)
        mem = self._optional(nv.nvmlDeviceGetMemoryInfo, handle)
        temp = self._optional(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
        power_mw = self._optional(nv.nvmlDeviceGetPowerUsage, handle)
        limit_mw = self._optional(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
        mig_enabled = self._mig_enabled(handle)
        return GpuSample(
            index=index,
            uuid=nv.nvmlDeviceGetUUID(handle),
            name=name,
            model=_canonical_model(name),
            utilisation_pct=None if util is None else float(util.gpu),
            memory_used_gib=None if mem is None else mem.used / _BYTES_PER_GIB,
            memory_total_gib=None if mem is None else mem.total / _BYTES_PER_GIB,
            temperature_c=None if temp is None else float(temp),
            power_w=None if power_mw is None else power_mw / _MW_PER_W,
            power_limit_w=None if limit_mw is None else limit_mw / _MW_PER_W,
            throttle_reasons=self._throttle_reasons(handle),
            mig_enabled=mig_enabled,
            mig_devices=self._mig_devices(handle) if mig_enabled else (),
        )

    def _throttle_reasons(self, handle: Any) -> tuple[str, ...] | None:
        nv = self._nvml
        # The newer name first; a driver older than the bindings may lack it (FunctionNotFound).
        for fn_name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            fn = getattr(nv, fn_name, None)
            if fn is None:
                continue
            try:
                return decode_reasons(fn(handle), self._reason_bits)
            except nv.NVMLError_FunctionNotFound:
                continue
            except nv.NVMLError_NotSupported:
                return None
        return None

    def _mig_enabled(self, handle: Any) -> bool | None:
        nv = self._nvml
        if not hasattr(nv, "nvmlDeviceGetMigMode"):
            return None
        mode = self._optional(nv.nvmlDeviceGetMigMode, handle)
        if mode is None:
            return None
        current, _pending = mode
        return current == nv.NVML_DEVICE_MIG_ENABLE

    def _mig_devices(self, handle: Any) -> tuple[MigSample, ...]:
        nv = self._nvml
        out: list[MigSample] = []
        for slot in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nv.NVMLError_NotFound:
                continue  # an empty slot: no MIG device was created there
            name = nv.nvmlDeviceGetName(mig)
            mem = self._optional(nv.nvmlDeviceGetMemoryInfo, mig)
            profile = _MIG_PROFILE.search(name)
            out.append(MigSample(
                slot=slot,
                uuid=nv.nvmlDeviceGetUUID(mig),
                name=name,
                profile=profile.group(1) if profile else None,
                gpu_instance_id=self._optional(nv.nvmlDeviceGetGpuInstanceId, mig),
                compute_instance_id=self._optional(nv.nvmlDeviceGetComputeInstanceId, mig),
                memory_used_gib=None if mem is None else mem.used / _BYTES_PER_GIB,
                memory_total_gib=None if mem is None else mem.total / _BYTES_PER_GIB,
            ))
        return tuple(out)

    def _optional(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None when the GPU does not support it or this driver lacks the function."""
        nv = self._nvml
        try:
            return fn(*args)
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            return None


def _canonical_model(name: str) -> str | None:
    try:
        return ids.gpu_model(name)
    except ids.UnknownIdentifier:
        return None


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def _reason_bits(nv: Any) -> dict[int, str]:
    """Bit value → short name, from the nvmlClocksEventReason* / nvmlClocksThrottleReason* constants present."""
    bits: dict[int, str] = {}
    for prefix in _REASON_PREFIXES:
        for attr in dir(nv):
            suffix = attr.removeprefix(prefix)
            if suffix == attr or suffix in _REASON_NOT_BITS:
                continue
            value = getattr(nv, attr)
            if isinstance(value, int) and value > 0 and value & (value - 1) == 0:
                bits.setdefault(value, _REASON_NAMES.get(suffix) or _snake(suffix))
    return bits


@functools.cache
def clock_event_bits() -> dict[int, str]:
    """Bit value → short name of the clock-event reasons, from the constants of the installed NVML bindings
    (``pynvml``; importing it needs no driver). DCGM's ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` carries the same
    bits (its ``DCGM_CLOCKS_EVENT_REASON_*`` are NVML's), so ``adapters.dcgm`` decodes with this table too."""
    import pynvml

    return _reason_bits(pynvml)


def decode_reasons(mask: int, bits: dict[int, str]) -> tuple[str, ...]:
    """Names of the bits set in ``mask``, lowest bit first; a bit no constant names is ``bit_0x…``."""
    names: list[str] = []
    bit = 1
    while bit <= mask:
        if mask & bit:
            names.append(bits.get(bit, f"bit_{bit:#x}"))
        bit <<= 1
    return tuple(names)


# --- sampling loop ------------------------------------------------------------------------------------


class Sampler(Protocol):
    def sample(self) -> NodeSample: ...


async def run_sampler(
    collector: Sampler,
    every_s: float,
    on_sample: Callable[[NodeSample], None],
    stop: asyncio.Event,
    *,
    clock: Clock | None = None,
    on_error: Callable[[Exception], None] | None = None,
) -> None:
    """Sample every ``every_s`` seconds of ``clock`` until ``stop`` is set.

    Each sample runs in a worker thread (NVML calls block). ``on_sample`` runs on the event loop. A sample
    that raises is logged, passed to ``on_error`` if given, and skipped; the loop goes on. Ticks are on a
    fixed grid from the start; a sample that overruns a tick skips it rather than sampling twice in a row.
    """
    if every_s <= 0:
        raise ValueError(f"every_s must be positive, got {every_s}")
    clock = clock or SystemClock()
    period = timedelta(seconds=every_s)
    next_at = clock.now()
    while not stop.is_set():
        try:
            sample = await asyncio.to_thread(collector.sample)
        except Exception as exc:
            log.warning("GPU telemetry sample failed, skipped: %s: %s", type(exc).__name__, exc, exc_info=True)
            if on_error is not None:
                on_error(exc)
        else:
            on_sample(sample)
        if stop.is_set():
            break
        now = clock.now()
        next_at += period
        while next_at <= now:
            next_at += period
        await _sleep_or_stop(clock, (next_at - now).total_seconds(), stop)


async def _sleep_or_stop(clock: Clock, seconds: float, stop: asyncio.Event) -> None:
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sleeper, stopper):
            task.cancel()


# --- command line -------------------------------------------------------------------------------------


def _format(sample: NodeSample) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    lines = [f"{sample.taken_at.isoformat()}  driver {sample.driver_version or 'n/a'}  {len(sample.gpus)} GPU(s)"]
    for g in sample.gpus:
        throttle = "n/a" if g.throttle_reasons is None else (",".join(g.throttle_reasons) or "none")
        lines.append(
            f"  gpu{g.index} {g.model or g.name}: util {num(g.utilisation_pct, '.0f')}%  "
            f"mem {num(g.memory_used_gib, '.1f')}/{num(g.memory_total_gib, '.1f')} GiB  "
            f"{num(g.temperature_c, '.0f')} °C  power {num(g.power_w, '.0f')}/{num(g.power_limit_w, '.0f')} W  "
            f"throttle {throttle}  mig {'n/a' if g.mig_enabled is None else ('on' if g.mig_enabled else 'off')}"
        )
        for m in g.mig_devices:
            lines.append(
                f"    mig{m.slot} {m.profile or m.name}: mem {num(m.memory_used_gib, '.1f')}/"
                f"{num(m.memory_total_gib, '.1f')} GiB  {m.uuid}"
            )
    lines.extend(f"  left out: {why}" for why in sample.left_out)
    return "\n".join(lines)


async def _cli_run(collector: NvmlCollector, every_s: float, count: int, as_json: bool) -> int:
    stop = asyncio.Event()
    ticks = 0
    failures = 0

    def tick() -> None:
        nonlocal ticks
        ticks += 1
        if count and ticks >= count:
            stop.set()

    def on_sample(sample: NodeSample) -> None:
        print(json.dumps(sample.to_json()) if as_json else _format(sample), flush=True)
        tick()

    def on_error(exc: Exception) -> None:
        nonlocal failures
        failures += 1
        print(f"sample failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        tick()

    await run_sampler(collector, every_s, on_sample, stop, on_error=on_error)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adapters.nvml", description="Print NVML GPU telemetry samples.")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples (default 1)")
    parser.add_argument("--count", type=int, default=5, help="samples to take, 0 for until interrupted (default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object per sample")
    args = parser.parse_args(argv)
    if args.every <= 0 or args.count < 0:
        parser.error("--every must be positive and --count at least 0")
    log.addHandler(logging.NullHandler())  # on_error prints each failed sample as one line instead
    collector = NvmlCollector()
    try:
        collector.open()
    except NvmlUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_cli_run(collector, args.every, args.count, args.json))
    except KeyboardInterrupt:
        return 130
    finally:
        collector.close()


if __name__ == "__main__":
    sys.exit(main())
