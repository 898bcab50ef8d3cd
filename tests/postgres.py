"""A PostgreSQL server that the tests start themselves: one per test session, a fresh database per test.

:class:`PostgresServer` runs ``initdb`` into a new temporary folder (user ``heliotrope``, trust
authentication), then ``pg_ctl start`` with the server listening on 127.0.0.1 on a free port, its socket
in that folder, and ``fsync=on`` (a test may rely on durability). :meth:`PostgresServer.create_database`
makes a new empty database and returns its URL, so tests never see each other's rows.

Fixtures (import them into a test module: ``from tests.postgres import postgres_dsn, postgres_server``):

- ``postgres_server`` (session scope): the started :class:`PostgresServer`, stopped (``pg_ctl stop -m fast``)
  and removed at the end of the session;
- ``postgres_dsn`` (function scope): the URL of a fresh database on it,
  ``postgresql://heliotrope@127.0.0.1:PORT/NAME`` (left in place: the server is removed with all of them).

The binaries are looked up on PATH, then under ``/usr/lib/postgresql/*/bin`` (Debian, Ubuntu) and
``/usr/pgsql-*/bin`` (RPM), newest version first. ``initdb`` and ``postgres`` refuse to run as root: as root
the server runs as the user ``postgres`` (``runuser -u postgres``, or ``su postgres``) with its folder owned by
that user. Without the binaries a test that needs the server is skipped with the install command, except
where the environment variable ``CI`` is ``true``: there it fails, so a CI run never passes by skipping.
``bash scripts/test-deps`` (run by ``make test``) installs them.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests.services import missing

INSTALL_HINT = "install it with: sudo apt-get install postgresql (or: bash scripts/test-deps)"
USER = "heliotrope"
RUN_AS_WHEN_ROOT = "postgres"


class PostgresMissing(RuntimeError):
    """No PostgreSQL server binaries (``initdb``, ``pg_ctl``, ``postgres``) here."""


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path))


def find_bindir() -> Path:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``; :class:`PostgresMissing` when there is none."""
    candidates: list[Path] = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates += [Path(on_path).parent, Path(on_path).resolve().parent]
    for pattern in ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin", "/usr/local/pgsql/bin"):
        candidates += [Path(p) for p in sorted(glob.glob(pattern), key=_version_key, reverse=True)]
    for folder in candidates:
        if all(os.access(folder / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres")):
            return folder
    raise PostgresMissing(f"PostgreSQL (initdb, pg_ctl, postgres) is not installed: {INSTALL_HINT}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as_prefix() -> list[str]:
    """How to run the server binaries: as ourselves, or, as root, as the user ``postgres``."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(RUN_AS_WHEN_ROOT)
    except KeyError:
        raise PostgresMissing(f"running as root, and there is no user {RUN_AS_WHEN_ROOT!r} to run PostgreSQL as "
                              "(initdb refuses root): run the tests as another user") from None
    runuser = shutil.which("runuser") or ("/usr/sbin/runuser" if os.access("/usr/sbin/runuser", os.X_OK) else None)
    if runuser:
        return [runuser, "-u", RUN_AS_WHEN_ROOT, "--"]
    return ["su", "-s", "/bin/sh", RUN_AS_WHEN_ROOT, "-c", '"$0" "$@"']


class PostgresServer:
    """One PostgreSQL server on 127.0.0.1 with its data and socket in a new temporary folder."""

    def __init__(self, port: int | None = None) -> None:
        self.bindir = find_bindir()
        self.prefix = _run_as_prefix()
        self.port = port or free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="heliotrope-pg-"))
        self.data = self.workdir / "data"
        self.log = self.workdir / "postgres.log"
        self.started = False
        self._names = itertools.count(1)
        if self.prefix:
            pw = pwd.getpwnam(RUN_AS_WHEN_ROOT)
            os.chown(self.workdir, pw.pw_uid, pw.pw_gid)

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.prefix, *args], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd=self.workdir)

    def start(self) -> None:
        """``initdb`` (the first time) then ``pg_ctl start -w``; RuntimeError with the output and the log's tail
        on failure."""
        if not (self.data / "PG_VERSION").exists():
            init = self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", USER, "--auth=trust",
                             "-E", "UTF8", "--no-locale", "--no-sync")
            if init.returncode != 0:
                raise RuntimeError(f"initdb failed ({init.returncode}):\n{init.stdout}\n{init.stderr}")
        options = (f"-p {self.port} -k {self.workdir} -c listen_addresses=127.0.0.1 -c fsync=on "
                   "-c max_connections=200")
        start = self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options,
                          "-w", "-t", "60", "start", timeout=90)
        if start.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed ({start.returncode}):\n{start.stdout}\n{start.stderr}\n"
                               f"{self.log_tail()}")
        self.started = True

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: every server process quits at once, nothing is flushed or checkpointed;
        the next :meth:`start` recovers from the write-ahead log, as after a crash."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        self.started = False

    def stop(self) -> None:
        if self.started:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop", timeout=60)
            self.started = False

    def cleanup(self) -> None:
        """Stop the server and remove its folder. Stopped at once (``crash``): a clean stop's checkpoint would
        first write out every database the session made (35 s at the end of a full run), only to delete them."""
        try:
            if self.started:
                self.crash()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    async def create_database(self) -> str:
        """A new empty database; its URL."""
        import asyncpg

        name = f"t{os.getpid()}_{next(self._names)}"
        conn = await asyncpg.connect(self.dsn(), timeout=30)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        return self.dsn(name)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) or "(the log is empty)"
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A started PostgreSQL server of the session's own; stopped and removed at the end of the session."""
    try:
        server = PostgresServer()
    except PostgresMissing as e:
        missing("PostgreSQL", str(e))
        raise  # not reached: skip and fail raise
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture
async def postgres_dsn(postgres_server: PostgresServer) -> AsyncIterator[str]:
    """The URL of a fresh, empty database on the session's server."""
    yield await postgres_server.create_database()
    # not dropped: DROP DATABASE forces a checkpoint (about a second); the whole server goes at the session's end
