"""The API server's clock as the Kubernetes adapter measures it, from the Date header of its answers
(``adapters.cluster_clock``)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from adapters.cluster_clock import ClusterClock
from broker.clock import ManualClock

T0 = datetime(2026, 11, 30, 16, 0, tzinfo=UTC)


def answer(clock: ClusterClock, server_ahead_s: float, rtt_s: float = 0.1, date: str | None = "") -> None:
    """An answer sent at T0 by the broker's clock and received ``rtt_s`` later, from a server whose clock is
    ``server_ahead_s`` ahead and which wrote its Date halfway (``date``: the header as given, None: none)."""
    written = T0 + timedelta(seconds=rtt_s / 2 + server_ahead_s)
    header = format_datetime(written.replace(microsecond=0), usegmt=True) if date == "" else date
    clock.observe(header, T0, T0 + timedelta(seconds=rtt_s))


@pytest.mark.parametrize(("answers", "skew_s"), [
    ([(600.0, 0.1)], 600.0),
    ([(-600.0, 0.1)], -600.0),
    ([(1.4, 0.1)], 0.0),
    ([(600.0, 7.0)], 0.0),
    ([(600.0, 0.1)] * 4 + [(0.0, 0.1)], 600.0),
    ([(600.0, 0.1)] * 4 + [(0.0, 0.1)] * 9, 0.0),
], ids=["a server 10 minutes ahead", "a server 10 minutes behind", "a skew under 2 s is taken as none",
        "an answer that took 7 s says too little", "one odd answer among the last nine moves it not",
        "a clock set right is followed"])
def test_the_skew_is_what_the_last_answers_dates_show(answers: list[tuple[float, float]], skew_s: float) -> None:
    clock = ClusterClock(ManualClock(T0), "kube")
    for ahead_s, rtt_s in answers:
        answer(clock, ahead_s, rtt_s)
    # (the Date is whole seconds: within a second of the truth, or none)
    assert clock.skew_s == pytest.approx(skew_s, abs=1.0)
    assert clock.now() == T0 + timedelta(seconds=clock.skew_s)


@pytest.mark.parametrize("date", [None, "", "yesterday", "Mon, 30 Nov 2026 16:10:00",
                                  "Mon, 30 Nov 2026 16:10:00 +99999999999999999999"],
                         ids=["no Date", "an empty one", "one that is no date", "one without its zone",
                              "one whose zone is too large a number"])
def test_an_answer_without_a_readable_date_leaves_the_clock_as_it_was(date: str | None) -> None:
    # (and raises nothing: the adapter reads every answer's Date before the answer itself, so a Date that raised
    # would fail the call, each call to that API server)
    clock = ClusterClock(ManualClock(T0), "kube")
    answer(clock, 600.0)
    clock.observe(date, T0, T0)  # (one that said no skew, were it read)
    assert clock.skew_s == pytest.approx(600.0, abs=1.0)


def test_a_skew_is_logged_once_and_again_when_it_goes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="adapters.kubernetes")
    clock = ClusterClock(ManualClock(T0), "kube")
    for _ in range(5):
        answer(clock, -600.0)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "site kube: the API server's clock is 10.0 minutes behind the broker's" in said[0]
    for _ in range(9):
        answer(clock, 0.0)
    assert len(caplog.records) == 2 and "agrees with the broker's again" in caplog.records[1].getMessage()
