"""The README's command lines, checked against the CLI they document.

Every complete ``heliotrope`` command the README shows in a code block (a ``$`` line of a console session, or
a line of a shell block, ``\\`` continuations joined) must parse with the CLI's own parser, and every file of
the repository it names (``config/``, ``data/``, ``tests/``, ``deploy/``) must exist: a renamed flag or a moved
example would otherwise leave a new user with a command that fails on the first try. Synopses, which show
alternatives and optional parts (``[--seed N]``, ``(--policy NAME | --compare all)``, ``...``), are not commands
and are left out; so are commands in running prose.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from broker.cli import parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# How a command starts: the console script on the PATH or in the virtualenv, after a pipe (`echo ... |`),
# run in a compose service (`docker compose ... exec SERVICE`), or the image's entrypoint (`docker run ...
# ghcr.io/heliotrope/heliotrope:TAG`).
COMMAND = re.compile(r"^(?:.*\|\s*|docker compose .*? exec \S+ |docker run .*? \S+/(?=heliotrope:))?(?:\.venv/bin/)?"
                     r"heliotrope(?::\S+)? (?P<args>.*)$")
SYNOPSIS = re.compile(r"[\[(]|\.\.\.")  # optional parts, alternatives, elisions: a synopsis, not a command
REPO_FOLDERS = ("config/", "data/", "tests/", "deploy/")


def readme_commands() -> list[tuple[int, str]]:
    """(line, arguments after `heliotrope`) of every complete command in the README's code blocks."""
    text = README.read_text(encoding="utf-8")
    out = []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        kind, body = block.group(1), block.group(2)
        first_line = text[:block.start(2)].count("\n") + 1
        lines = body.split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            line = line.strip()
            if kind == "console":
                if not line.startswith("$ "):
                    continue  # the output the command printed
                line = line[2:]
            line = re.sub(r"\s+#\s.*$", "", line)  # a comment after the command
            m = COMMAND.match(line)
            if m and not SYNOPSIS.search(m.group("args")):
                out.append((first_line + start, m.group("args")))
    return out


COMMANDS = readme_commands()


def test_the_readme_shows_commands_to_check() -> None:
    # The tour, authentication, the agent, the simulator and the deployment each show some.
    assert len(COMMANDS) >= 25


@pytest.mark.parametrize(("line", "args"), COMMANDS, ids=[f"README line {n}: heliotrope {a[:60]}" for n, a in COMMANDS])
def test_every_readme_command_parses_with_the_cli(line: int, args: str) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser().parse_args(shlex.split(args))
    except SystemExit:
        pytest.fail(f"README line {line}: heliotrope {args}\n{err.getvalue()}")


@pytest.mark.parametrize(("line", "args"), COMMANDS, ids=[f"README line {n}: heliotrope {a[:60]}" for n, a in COMMANDS])
def test_every_repository_file_a_readme_command_names_exists(line: int, args: str) -> None:
    for word in shlex.split(args):
        for value in word.split("=")[-1:] if word.startswith("--") else [word]:
            if value.startswith(REPO_FOLDERS) and not value.startswith("deploy/.env"):
                assert (ROOT / value).exists(), f"README line {line}: {value} is not in the repository"
