"""NVML telemetry (adapters.nvml) against a fake NVML module that mirrors pynvml's functions, error classes
and constants, so what is tested is exactly what the collector asks of the real bindings."""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import pynvml
import pytest

from adapters.nvml import (
    NodeSample,
    NvmlCollector,
    NvmlUnavailable,
    _cli_run,
    decode_reasons,
    run_sampler,
)
from broker.clock import ManualClock
from broker.models import SiteState

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3


# --- the fake at the nvidia-ml-py boundary ------------------------------------------------------------


@dataclass
class FakeGpu:
    """One device as the fake driver knows it. ``None`` for a metric: the device raises NotSupported."""

    name: str
    uuid: str
    util_pct: int | None = 0
    mem_used: int | None = 0
    mem_total: int = 80 * GIB
    temp_c: int | None = 30
    power_mw: int | None = 60_000
    power_limit_mw: int | None = 400_000
    clock_reasons: int | None = 0
    mig_mode: tuple[int, int] | None = (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE)
    max_mig: int = 0
    mig_slots: dict[int, FakeGpu] = field(default_factory=dict)
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    handle_error: type[pynvml.NVMLError] | None = None  # nvmlDeviceGetHandleByIndex raises it (NoPermission)
    read_error: type[pynvml.NVMLError] | None = None  # a read of the device raises it (GpuIsLost mid-sample)


def _supported(value):
    if value is None:
        raise pynvml.NVMLError_NotSupported()
    return value


class FakeNvml:
    """The parts of ``pynvml`` the collector uses, with the same names and signatures; errors and
    constants are the real module's own."""

    def __init__(self, gpus: list[FakeGpu], init_error: type[pynvml.NVMLError] | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialised = False
        self.has_event_reasons = True  # False: like a driver older than the bindings
        self.fail_next: pynvml.NVMLError | None = None

    def _live(self) -> None:
        if not self.initialised:
            raise pynvml.NVMLError_Uninitialized()

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error()
        self.initialised = True

    def nvmlShutdown(self):
        self._live()
        self.initialised = False

    def nvmlSystemGetDriverVersion(self):
        self._live()
        return "570.124.06"

    def nvmlDeviceGetCount(self):
        self._live()
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._live()
        if self.gpus[index].handle_error is not None:
            raise self.gpus[index].handle_error()
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle):
        if handle.read_error is not None:
            raise handle.read_error()
        return handle.name

    def nvmlDeviceGetUUID(self, handle):
        return handle.uuid

    def nvmlDeviceGetUtilizationRates(self, handle):
        return pynvml.c_nvmlUtilization_t(gpu=_supported(handle.util_pct), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        used = _supported(handle.mem_used)
        return pynvml.c_nvmlMemory_t(total=handle.mem_total, free=handle.mem_total - used, used=used)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return _supported(handle.temp_c)

    def nvmlDeviceGetPowerUsage(self, handle):
        return _supported(handle.power_mw)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return _supported(handle.power_limit_mw)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        if not self.has_event_reasons:
            raise pynvml.NVMLError_FunctionNotFound()
        return _supported(handle.clock_reasons)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return _supported(handle.clock_reasons)

    def nvmlDeviceGetMigMode(self, device):
        return list(_supported(device.mig_mode))

    def nvmlDeviceGetMaxMigDeviceCount(self, device):
        return device.max_mig

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index):
        if index not in device.mig_slots:
            raise pynvml.NVMLError_NotFound()
        return device.mig_slots[index]

    def nvmlDeviceGetGpuInstanceId(self, device):
        return _supported(device.gpu_instance_id)

    def nvmlDeviceGetComputeInstanceId(self, device):
        return _supported(device.compute_instance_id)


for _name in dir(pynvml):
    if _name.startswith(("NVMLError", "NVML_", "nvmlClocksEventReason", "nvmlClocksThrottleReason")):
        setattr(FakeNvml, _name, getattr(pynvml, _name))


# --- builders -----------------------------------------------------------------------------------------


def mig_device(slot: int, profile: str, used_gib: float, total_gib: float, gi: int) -> FakeGpu:
    return FakeGpu(
        name=f"NVIDIA A100-SXM4-80GB MIG {profile}", uuid=f"MIG-a100-slot{slot}",
        mem_used=int(used_gib * GIB), mem_total=int(total_gib * GIB),
        gpu_instance_id=gi, compute_instance_id=0, mig_mode=None, util_pct=None,
    )


def a100_in_mig_mode() -> FakeGpu:
    """An A100-80GB split into a 3g.40gb and a 1g.10gb MIG device (slot 1 empty); utilisation is not
    reported for a GPU in MIG mode, as real drivers do."""
    return FakeGpu(
        name="NVIDIA A100-SXM4-80GB", uuid="GPU-a100", util_pct=None,
        mem_used=20 * GIB, mem_total=80 * GIB, temp_c=41, power_mw=250_500, power_limit_mw=400_000,
        clock_reasons=0,
        mig_mode=(pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE), max_mig=7,
        mig_slots={0: mig_device(0, "3g.40gb", 12.0, 39.5, gi=1), 2: mig_device(2, "1g.10gb", 0.5, 9.75, gi=9)},
    )


def h100_throttled() -> FakeGpu:
    """A busy, hot H100 held back by its power cap, thermal slowdown and the power brake; it does not
    report its power limit."""
    return FakeGpu(
        name="NVIDIA H100 80GB HBM3", uuid="GPU-h100", util_pct=93,
        mem_used=int(70.5 * GIB), mem_total=80 * GIB, temp_c=83, power_mw=690_000, power_limit_mw=None,
        clock_reasons=(pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
                       | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown),
    )


def two_gpu_node() -> FakeNvml:
    return FakeNvml([a100_in_mig_mode(), h100_throttled()])


def sample_of(fake: FakeNvml, clock: ManualClock | None = None) -> NodeSample:
    with NvmlCollector(fake, clock=clock) as collector:
        return collector.sample()


# --- the fake is faithful -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(n for n, v in vars(FakeNvml).items() if n.startswith("nvml") and callable(v)))
def test_the_fake_has_the_real_bindings_signature(name):
    real = inspect.signature(getattr(pynvml, name))
    fake = inspect.signature(getattr(FakeNvml([]), name))
    assert list(fake.parameters.values()) == list(real.parameters.values())


# --- what one sample reports --------------------------------------------------------------------------


VALUES = [
    pytest.param(0, "model", "a100-80gb", id="the A100's product name becomes the canonical a100-80gb"),
    pytest.param(1, "model", "h100-80gb", id="the H100's product name becomes the canonical h100-80gb"),
    pytest.param(0, "uuid", "GPU-a100", id="each GPU carries its UUID"),
    pytest.param(1, "utilisation_pct", 93.0, id="utilisation is a percentage"),
    pytest.param(0, "memory_used_gib", 20.0, id="memory used is in GiB"),
    pytest.param(1, "memory_used_gib", 70.5, id="fractional GiB are kept"),
    pytest.param(1, "memory_total_gib", 80.0, id="memory total is in GiB"),
    pytest.param(1, "temperature_c", 83.0, id="temperature is in degrees Celsius"),
    pytest.param(0, "power_w", 250.5, id="power draw is in watts, not milliwatts"),
    pytest.param(0, "power_limit_w", 400.0, id="the enforced power limit is in watts"),
    pytest.param(0, "mig_enabled", True, id="a GPU in MIG mode says so"),
    pytest.param(1, "mig_enabled", False, id="a MIG-capable GPU not in MIG mode says so"),
]


@pytest.mark.parametrize(("gpu", "metric", "expected"), VALUES)
def test_a_sample_reports_each_metric_in_the_units_a_user_reads(gpu, metric, expected):
    sample = sample_of(two_gpu_node())
    assert [g.index for g in sample.gpus] == [0, 1]
    assert getattr(sample.gpus[gpu], metric) == pytest.approx(expected)


def test_a_sample_is_stamped_with_the_injected_clock_and_the_driver_version():
    clock = ManualClock()
    sample = sample_of(two_gpu_node(), clock)
    assert sample.taken_at == clock.now()
    assert sample.driver_version == "570.124.06"


REASONS = [
    pytest.param(h100_throttled, True, ("sw_power_cap", "hw_thermal", "power_brake"),
                 id="set clock-event bits are decoded to short names"),
    pytest.param(a100_in_mig_mode, True, (), id="a GPU whose clocks run free has no reasons"),
    pytest.param(h100_throttled, False, ("sw_power_cap", "hw_thermal", "power_brake"),
                 id="a driver without the clock-event call falls back to the throttle-reasons call"),
]


@pytest.mark.parametrize(("gpu", "event_reasons_call", "expected"), REASONS)
def test_throttle_reasons_are_named(gpu, event_reasons_call, expected):
    fake = FakeNvml([gpu()])
    fake.has_event_reasons = event_reasons_call
    assert sample_of(fake).gpus[0].throttle_reasons == expected


def test_every_known_reason_bit_has_a_short_name_and_an_unknown_bit_is_still_shown():
    bits = pynvml.nvmlClocksThrottleReasonGpuIdle | pynvml.nvmlClocksThrottleReasonHwSlowdown
    bits |= pynvml.nvmlClocksThrottleReasonSwThermalSlowdown | 0x8000
    gpu = FakeGpu(name="NVIDIA L4", uuid="GPU-l4", clock_reasons=bits)
    assert sample_of(FakeNvml([gpu])).gpus[0].throttle_reasons == ("idle", "hw_slowdown", "sw_thermal", "bit_0x8000")
    assert decode_reasons(0, {}) == ()


def test_mig_devices_are_listed_with_profile_and_memory_and_empty_slots_skipped():
    migs = sample_of(two_gpu_node()).gpus[0].mig_devices
    assert [(m.slot, m.profile, m.gpu_instance_id) for m in migs] == [(0, "3g.40gb", 1), (2, "1g.10gb", 9)]
    assert [m.uuid for m in migs] == ["MIG-a100-slot0", "MIG-a100-slot2"]
    assert [(m.memory_used_gib, m.memory_total_gib) for m in migs] == [(12.0, 39.5), (0.5, 9.75)]
    assert sample_of(two_gpu_node()).gpus[1].mig_devices == ()


def test_a_metric_the_gpu_does_not_support_is_none_not_a_crash():
    old = FakeGpu(name="Tesla K80", uuid="GPU-k80", util_pct=None, mem_used=None, temp_c=None, power_mw=None,
                  power_limit_mw=None, clock_reasons=None, mig_mode=None)
    gpu = sample_of(FakeNvml([old])).gpus[0]
    assert gpu.model is None  # a model heliotrope does not know is reported by name, not refused
    assert gpu.name == "Tesla K80"
    unsupported = ("utilisation_pct", "memory_used_gib", "memory_total_gib", "temperature_c", "power_w",
                   "power_limit_w", "throttle_reasons", "mig_enabled")
    assert {m: getattr(gpu, m) for m in unsupported} == dict.fromkeys(unsupported)
    assert sample_of(two_gpu_node()).gpus[1].power_limit_w is None


def test_an_error_other_than_not_supported_fails_the_sample():
    fake = two_gpu_node()
    with NvmlCollector(fake) as collector:
        fake.fail_next = pynvml.NVMLError_GpuIsLost()
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            collector.sample()
        assert len(collector.sample().gpus) == 2


@pytest.mark.parametrize(("broken", "why"), [
    ({"handle_error": pynvml.NVMLError_NoPermission}, "GPU 1: no permission (NVMLError_NoPermission)"),
    ({"read_error": pynvml.NVMLError_GpuIsLost}, "GPU 1: lost (fallen off the bus) (NVMLError_GpuIsLost)"),
], ids=["a GPU this process may not use (counted by nvmlDeviceGetCount all the same)",
        "a GPU that has fallen off the bus"])
def test_one_gpu_that_cannot_be_read_is_left_out_and_the_others_are_reported(broken, why, caplog):
    h100 = h100_throttled()
    fake = FakeNvml([a100_in_mig_mode(), FakeGpu(name="NVIDIA H100 80GB HBM3", uuid="GPU-2", **broken), h100])
    with NvmlCollector(fake) as collector:
        first, second = collector.sample(), collector.sample()
    assert [g.uuid for g in first.gpus] == ["GPU-a100", "GPU-h100"]
    assert [g.index for g in first.gpus] == [0, 2]
    assert first.left_out == second.left_out == (why,)
    assert first.telemetry().temperature_c_max == 83.0
    assert [r.levelname for r in caplog.records if "GPU 1 cannot be read" in r.message] == ["WARNING"]  # once


def test_sampling_needs_open_and_close_shuts_nvml_down():
    fake = two_gpu_node()
    collector = NvmlCollector(fake)
    with pytest.raises(RuntimeError, match="before open"):
        collector.sample()
    collector.open()
    assert fake.initialised
    collector.close()
    collector.close()  # a second close is harmless
    assert not fake.initialised


# --- node telemetry -----------------------------------------------------------------------------------


def test_telemetry_averages_utilisation_sums_memory_and_power_and_keeps_the_hottest_gpu():
    telemetry = sample_of(two_gpu_node()).telemetry()
    assert telemetry.gpu_utilisation_pct == pytest.approx(93.0)  # the MIG-mode A100 reports none
    assert telemetry.memory_used_gib == pytest.approx(90.5)
    assert telemetry.memory_total_gib == pytest.approx(160.0)
    assert telemetry.temperature_c_max == pytest.approx(83.0)
    assert telemetry.power_w == pytest.approx(940.5)
    # The H100's power cap, thermal slowdown and power brake hold its clocks down; the A100's run free.
    assert telemetry.throttled_pct == pytest.approx(50.0)
    assert telemetry.throttle_reasons == {"hw_thermal": 1, "power_brake": 1, "sw_power_cap": 1}
    assert SiteState(site="lab", telemetry=telemetry).telemetry == telemetry


def test_telemetry_of_gpus_reporting_nothing_is_zero():
    old = FakeGpu(name="Tesla K80", uuid="GPU-k80", util_pct=None, mem_used=None, temp_c=None, power_mw=None)
    telemetry = sample_of(FakeNvml([old])).telemetry()
    assert (telemetry.gpu_utilisation_pct, telemetry.memory_used_gib, telemetry.power_w) == (0.0, 0.0, 0.0)


def test_a_node_whose_gpus_give_no_clock_event_reasons_reports_no_throttling_rather_than_none_throttled():
    old = FakeGpu(name="Tesla K80", uuid="GPU-k80", util_pct=None, mem_used=None, temp_c=None, power_mw=None,
                  clock_reasons=None)
    telemetry = sample_of(FakeNvml([old])).telemetry()
    assert telemetry.throttled_pct is None and telemetry.throttle_reasons == {}
    idle = sample_of(FakeNvml([h100_throttled(), replace(h100_throttled(), uuid="GPU-2", clock_reasons=0)]))
    assert idle.telemetry().throttled_pct == pytest.approx(50.0)  # one unthrottled GPU counts in the share


# --- no driver ----------------------------------------------------------------------------------------


NO_NVML = [
    pytest.param(pynvml.NVMLError_LibraryNotFound,
                 "no NVIDIA driver: libnvidia-ml.so.1 not found; this machine cannot report GPU telemetry",
                 id="no driver library says so and names the library"),
    pytest.param(pynvml.NVMLError_DriverNotLoaded, "NVIDIA driver not loaded",
                 id="a driver that is not loaded says so"),
    pytest.param(pynvml.NVMLError_NoPermission, "NVML failed to start: Insufficient Permissions",
                 id="any other start-up error names NVML's own reason"),
]


@pytest.mark.parametrize(("error", "message"), NO_NVML)
def test_open_without_a_usable_driver_raises_a_clear_error(error, message):
    with pytest.raises(NvmlUnavailable, match="cannot report GPU telemetry") as raised:
        NvmlCollector(FakeNvml([], init_error=error)).open()
    assert message in str(raised.value)
    assert isinstance(raised.value.__cause__, error)


def _has_nvidia_driver() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_the_command_line_reads_the_gpus_or_says_in_one_line_that_it_cannot():
    done = subprocess.run([sys.executable, "-m", "adapters.nvml", "--count", "1", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    if _has_nvidia_driver():  # a GPU machine: one sample, every GPU with its model and memory
        assert done.returncode == 0, done.stderr
        sample = json.loads(done.stdout.splitlines()[0])
        assert sample["gpus"] and all(g["memory_total_gib"] > 0 for g in sample["gpus"])
        return
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: no NVIDIA driver: libnvidia-ml.so.1 not found; this machine cannot report GPU telemetry"
    ]


# --- the sampling loop --------------------------------------------------------------------------------


async def until(condition: Callable[[], bool]) -> None:
    """Wait (on real time, bounded) for work done in the sampler's worker thread."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), timeout=10)


async def test_the_sampler_samples_once_per_period_of_its_clock():
    clock = ManualClock()
    start = clock.now()
    got: list[NodeSample] = []
    stop = asyncio.Event()
    with NvmlCollector(two_gpu_node(), clock=clock) as collector:
        task = asyncio.create_task(run_sampler(collector, 10.0, got.append, stop, clock=clock))
        await until(lambda: len(got) == 1)
        await clock.advance(9.0)
        assert len(got) == 1  # not before the period is up
        await clock.advance(1.0)
        await until(lambda: len(got) == 2)
        await clock.advance(10.0)
        await until(lambda: len(got) == 3)
        stop.set()
        await asyncio.wait_for(task, timeout=10)
    assert [s.taken_at - start for s in got] == [timedelta(0), timedelta(seconds=10), timedelta(seconds=20)]


async def test_the_sampler_on_the_system_clock_stops_when_told():
    got: list[NodeSample] = []
    stop = asyncio.Event()

    def on_sample(sample: NodeSample) -> None:
        got.append(sample)
        if len(got) == 3:
            stop.set()

    with NvmlCollector(two_gpu_node()) as collector:
        await asyncio.wait_for(run_sampler(collector, 0.01, on_sample, stop), timeout=10)
    assert len(got) == 3


class FlakyCollector:
    """Fails its second sample, then recovers."""

    def __init__(self, inner: NvmlCollector) -> None:
        self.inner = inner
        self.calls = 0

    def sample(self) -> NodeSample:
        self.calls += 1
        if self.calls == 2:
            raise pynvml.NVMLError_Timeout()
        return self.inner.sample()


async def test_a_sample_that_fails_is_logged_and_skipped_and_sampling_goes_on(caplog):
    got: list[NodeSample] = []
    errors: list[Exception] = []
    stop = asyncio.Event()

    def on_sample(sample: NodeSample) -> None:
        got.append(sample)
        if len(got) == 3:
            stop.set()

    with NvmlCollector(two_gpu_node()) as inner, caplog.at_level(logging.WARNING, logger="adapters.nvml"):
        flaky = FlakyCollector(inner)
        await asyncio.wait_for(run_sampler(flaky, 0.01, on_sample, stop, on_error=errors.append), timeout=10)
    assert flaky.calls == 4
    assert len(got) == 3
    assert [type(e) for e in errors] == [pynvml.NVMLError_Timeout]
    assert "GPU telemetry sample failed, skipped: NVMLError_Timeout" in caplog.text


async def test_the_sampler_refuses_a_period_that_is_not_positive():
    with pytest.raises(ValueError, match="every_s must be positive"):
        await run_sampler(FlakyCollector(NvmlCollector(two_gpu_node())), 0, lambda s: None, asyncio.Event())


# --- command line with the fake -----------------------------------------------------------------------


@pytest.mark.parametrize("as_json", [False, True], ids=["text output", "json output"])
async def test_the_command_line_prints_the_asked_number_of_samples(as_json, capsys):
    with NvmlCollector(two_gpu_node()) as collector:
        rc = await asyncio.wait_for(_cli_run(collector, 0.01, 2, as_json), timeout=10)
    out = capsys.readouterr().out
    assert rc == 0
    if as_json:
        rows = [json.loads(line) for line in out.splitlines()]
        assert len(rows) == 2
        assert rows[0]["gpus"][1]["throttle_reasons"] == ["sw_power_cap", "hw_thermal", "power_brake"]
    else:
        assert out.count("2 GPU(s)") == 2
        assert "gpu1 h100-80gb: util 93%  mem 70.5/80.0 GiB  83 °C  power 690/n/a W" in out
        assert "mig2 1g.10gb: mem 0.5/9.8 GiB" in out
