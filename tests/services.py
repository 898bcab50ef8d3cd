"""What a test does when a server it needs (Mosquitto, PostgreSQL) cannot be started."""

from __future__ import annotations

import os

import pytest


def missing(service: str, reason: str) -> None:
    """Skip on a developer's machine; fail in CI (``CI=true``), where every service must start."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the {service} tests must not be skipped in CI)", pytrace=False)
    pytest.skip(reason)
