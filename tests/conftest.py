"""Shared fixtures: a broker server started as a real subprocess, free ports, temporary configs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
HELIOTROPE = [sys.executable, "-m", "broker.cli"]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the decision kernels (Numba) once, before any test: on a fresh clone that takes seconds and
    writes the on-disk cache, which every broker this suite starts (in process or as a server process)
    then loads in milliseconds, so no test's start-up waits for a compiler."""
    from policies.timeshift import warm_up

    warm_up()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TWO_SITES = {
    "broker": {"cycle_interval_s": 0.2},
    "sites": [
        {
            "name": "alpha", "region": "gcp:us-east4", "grid_zone": "US-MIDA-PJM", "timezone": "America/New_York",
            "latitude": 39.0, "longitude": -77.5,
            "gpus": [{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1}],
            "usd_per_gpu_hour": {"a100-80gb": 5.7},
            "adapter": {"kind": "simulated", "dispatch_delay_s": 0.01},
        },
        {
            "name": "beta", "region": "gcp:europe-west3", "grid_zone": "DE-LU", "timezone": "Europe/Berlin",
            "latitude": 50.1, "longitude": 8.7,
            "gpus": [{"model": "l4", "gpus_per_node": 4, "nodes": 2}],
            "usd_per_gpu_hour": {"l4": 0.83},
            "adapter": {"kind": "simulated", "dispatch_delay_s": 0.01},
        },
    ],
}


@dataclass
class ServerProcess:
    url: str
    port: int
    db: Path
    config: Path
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def start(self) -> None:
        assert self.log is not None
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [*HELIOTROPE, "serve", "--config", str(self.config), "--db", str(self.db), "--port", str(self.port)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"server did not start in 20 s:\n{self.log.read_text()}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[callable]:
    started: list[ServerProcess] = []

    def make(config: dict | None = None) -> ServerProcess:
        cfg = tmp_path / f"config-{len(started)}.yaml"
        cfg.write_text(yaml.safe_dump(config if config is not None else TWO_SITES))
        port = free_port()
        srv = ServerProcess(f"http://127.0.0.1:{port}", port, tmp_path / "broker.db", cfg, log=tmp_path / "server.log")
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def server(server_factory) -> ServerProcess:
    srv = server_factory()
    srv.start()
    return srv


SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The project's shared real data (``../shared/data``); a test that needs it fails without it."""
    assert (SHARED_DATA / "SOURCES.md").exists(), (
        f"the shared data is not at {SHARED_DATA}: clone the repository with shared/ beside it")
    return SHARED_DATA
