"""A Mosquitto MQTT broker that a test (or a benchmark) starts as a real subprocess, stops, kills and restarts.

:class:`Mosquitto` writes its own configuration into a temporary folder (listener on 127.0.0.1 only,
anonymous clients allowed, persistence into that folder so persistent sessions, their queued QoS 1 messages
and retained messages survive a restart; an autosave every ``autosave_interval_s`` so that even a SIGKILL
loses at most that much), starts ``mosquitto -c FILE`` on a free port and waits until the port accepts
connections. :meth:`Mosquitto.restart` brings it back on the *same* port, as a real broker restart would.
With ``tls=MosquittoTls(cafile, certfile, keyfile)`` it also listens with TLS on ``tls_port`` (127.0.0.1),
asking every client for a certificate signed by ``cafile`` when ``require_certificate`` is set.

The pytest fixture ``mosquitto`` (function scope: a fresh broker per test, so a test that kills it disturbs
no other) yields a started :class:`Mosquitto` and always stops it at teardown. Use it with::

    from tests.mosquitto import mosquitto_fixture  # noqa: F401  (registers the fixture "mosquitto")

    async def test_something(mosquitto: Mosquitto) -> None:
        settings = mosquitto.settings()

Without the ``mosquitto`` binary a test using the fixture is skipped with the install command, except where
the environment variable ``CI`` is ``true``: there it fails, so a CI run never passes by skipping.
``bash scripts/test-deps`` (run by ``make test``) installs it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker.models import MqttSettings
from tests.services import missing

INSTALL_HINT = "install it with: sudo apt-get install mosquitto (or: bash scripts/test-deps)"


class MosquittoMissing(RuntimeError):
    """No ``mosquitto`` binary on PATH nor at /usr/sbin/mosquitto."""


def find_mosquitto() -> str:
    """The path of the ``mosquitto`` binary; :class:`MosquittoMissing` when there is none."""
    path = shutil.which("mosquitto")
    if path:
        return path
    for candidate in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise MosquittoMissing(f"mosquitto (the MQTT broker) is not installed: {INSTALL_HINT}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_nofile_limit(needed: int) -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit (children started later inherit it).
    Returns (soft, hard) afterwards; the caller compares the soft limit with what it ``needed``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed and (hard == resource.RLIM_INFINITY or soft < hard):
        target = hard if hard != resource.RLIM_INFINITY else max(needed, 65536)
        with contextlib.suppress(ValueError, OSError):  # best effort: the limit may not be raised here
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


@dataclass(frozen=True)
class MosquittoTls:
    """A TLS listener's PEM files: the server's certificate and key, and the CA clients are checked against."""

    cafile: Path
    certfile: Path
    keyfile: Path
    require_certificate: bool = False


class Mosquitto:
    """One Mosquitto process on 127.0.0.1, configured and logging into ``workdir`` (a new temporary folder when
    None, removed by :meth:`cleanup`)."""

    def __init__(self, workdir: Path | None = None, port: int | None = None, *, persistence: bool = True,
                 autosave_interval_s: int = 1, max_queued_messages: int = 100_000,
                 log_connections: bool = True, extra_config: list[str] | tuple[str, ...] = (),
                 tls: MosquittoTls | None = None) -> None:
        self.binary = find_mosquitto()
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="mosquitto-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.config = self.workdir / "mosquitto.conf"
        self.log = self.workdir / "mosquitto.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        lines = [
            f"listener {self.port} 127.0.0.1",
            "allow_anonymous true",
            f"persistence {'true' if persistence else 'false'}",
            f"persistence_location {self.workdir}/",
            "persistence_file mosquitto.db",
            f"autosave_interval {autosave_interval_s}",
            f"max_queued_messages {max_queued_messages}",
            f"log_dest file {self.log}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            f"connection_messages {'true' if log_connections else 'false'}",
            "log_timestamp_format %H:%M:%S",
        ]
        if os.geteuid() == 0:
            # Run as root, Mosquitto drops to the user "mosquitto", which may not write here: stay who we are.
            lines.append(f"user {pwd.getpwuid(os.geteuid()).pw_name}")
        lines.extend(extra_config)
        self.tls_port = free_port() if tls is not None else None
        if tls is not None:  # a second listener, last: the options after it belong to it
            lines += [f"listener {self.tls_port} 127.0.0.1", f"cafile {tls.cafile}", f"certfile {tls.certfile}",
                      f"keyfile {tls.keyfile}",
                      f"require_certificate {'true' if tls.require_certificate else 'false'}"]
        self.config.write_text("\n".join(lines) + "\n")

    # --- life ---

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc is not None else None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start ``mosquitto -c FILE`` and wait until its port accepts connections (RuntimeError with the log's
        tail when it exits or does not listen within ``timeout_s``)."""
        if self.running:
            return
        out = (self.workdir / "mosquitto.stdout").open("ab")
        try:
            self.proc = subprocess.Popen([self.binary, "-c", str(self.config)], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            out.close()
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode} on start:\n{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"mosquitto did not listen on 127.0.0.1:{self.port} within {timeout_s:g} s:\n"
                                       f"{self.log_tail()}") from None
                time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Mosquitto saves its persistence file and exits), then wait; SIGKILL if it does not."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: a crash. What changed since the last autosave is lost."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def restart(self, *, kill: bool = False, down_s: float = 0.0) -> None:
        """Stop (or kill) it, stay down ``down_s``, and start it again on the same port."""
        if kill:
            self.kill()
        else:
            self.stop()
        if down_s > 0:
            time.sleep(down_s)
        self.start()

    def cleanup(self) -> None:
        """Stop it and remove its folder if this object made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # --- for clients ---

    def settings(self, **overrides: object) -> MqttSettings:
        """How the broker's hub and the agents reach it: short keepalive and reconnect delays for tests."""
        values: dict[str, object] = {"host": "127.0.0.1", "port": self.port, "keepalive_s": 2,
                                     "reconnect_max_s": 0.5}
        return MqttSettings(**(values | overrides))

    def log_tail(self, lines: int = 30) -> str:
        text = ""
        for path in (self.log, self.workdir / "mosquitto.stdout"):
            if path.exists():
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:]) or "(the log is empty)"

    def __enter__(self) -> Mosquitto:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


@pytest.fixture(name="mosquitto")
def mosquitto_fixture(tmp_path: Path) -> Iterator[Mosquitto]:
    """A started Mosquitto of this test's own (persistent, 127.0.0.1, a free port); stopped at teardown."""
    try:
        broker = Mosquitto(tmp_path / "mosquitto")
    except MosquittoMissing as e:
        missing("MQTT", str(e))
        raise  # not reached: skip and fail raise
    try:
        broker.start()
        yield broker
    finally:
        broker.cleanup()


mosquitto = mosquitto_fixture
"""The same fixture under its own name, for ``from tests.mosquitto import mosquitto``."""
