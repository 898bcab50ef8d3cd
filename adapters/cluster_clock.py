"""The API server's clock, as the broker's clock sees it: how far it is ahead (``skew_s``, seconds; negative:
behind), measured from the HTTP ``Date`` header of the server's answers.

The Kubernetes adapter ages what waits in the cluster by the cluster's own timestamps (a Pod's PodScheduled
``lastTransitionTime`` and ``startTime``, a Job's ``creationTimestamp``), each written by the API server's
clock. Compared with the broker's clock, a broker host minutes ahead withdrew Pods minutes early, and one behind
minutes late. :meth:`ClusterClock.now` is the broker's clock plus the skew: the cluster's time now, to compare
those timestamps with.

Each answer's ``Date`` (whole seconds) was written between the request's sending and the answer's arrival, by
the broker's clock: the server's time then was in [Date, Date + 1 s), so the skew is in
[Date - received, Date + 1 s - sent]. A sample is the middle of that interval; one wider than ``MAX_WIDTH_S``
(an answer that took seconds) says too little and is dropped. The estimate is the median of the last
``SAMPLES`` (one odd answer, a proxy's cached Date, moves it not at all), and a skew under ``IGNORED_S`` is taken
as none: the header's resolution and the round trip make smaller ones noise. A skew of ``LOGGED_S`` or more is
logged once (again when it has moved by that much since, or once it has gone). An answer without a readable
``Date`` is no sample, and without samples the skew is 0: the broker's clock is taken for the cluster's.

No I/O, no clock of its own: the adapter passes each answer's ``Date`` and its own times in. To turn it off
there is nothing to set: an API server (or a proxy before it) that sends no ``Date`` leaves it at 0.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from datetime import datetime, timedelta
from email.utils import parsedate_to_datetime

from broker.clock import Clock

log = logging.getLogger("adapters.kubernetes")

SAMPLES = 9  # the answers the estimate is the median of
MAX_WIDTH_S = 5.0  # a sample whose interval (the Date's second plus the round trip) is wider is dropped
IGNORED_S = 2.0  # a skew under this is taken as none
LOGGED_S = 5.0  # a skew this large is logged (once, and again when it has moved by as much)


class ClusterClock:
    """The cluster's time by ``clock`` (the adapter's) and the skew its answers show; ``site`` names it in the
    log."""

    def __init__(self, clock: Clock, site: str) -> None:
        self._clock = clock
        self.site = site
        self._samples: deque[float] = deque(maxlen=SAMPLES)
        self.skew_s = 0.0  # the skew applied: the estimate, or 0 under IGNORED_S
        self._logged_s: float | None = None  # the skew last logged

    def now(self) -> datetime:
        """The cluster's time now: the adapter's clock plus the skew."""
        return self._clock.now() + timedelta(seconds=self.skew_s)

    def observe(self, date: str | None, sent: datetime, received: datetime) -> None:
        """An answer with header ``Date`` (RFC 7231, e.g. ``Mon, 30 Nov 2026 16:20:50 GMT``) to a request sent at
        ``sent`` and answered at ``received`` by the adapter's clock."""
        if not date:
            return
        try:
            server = parsedate_to_datetime(date)
        except (TypeError, ValueError, IndexError, OverflowError):  # (a zone too large for a C int overflows)
            return
        if server.tzinfo is None:  # (an HTTP date is GMT; one without a zone is no HTTP date)
            return
        low = (server - received).total_seconds()
        high = (server - sent).total_seconds() + 1.0
        if high - low > MAX_WIDTH_S or high < low:
            return
        self._samples.append((low + high) / 2)
        estimate = statistics.median(self._samples)
        self.skew_s = estimate if abs(estimate) >= IGNORED_S else 0.0
        self._log()

    def _log(self) -> None:
        skew = self.skew_s
        if skew == 0.0 and self._logged_s is not None:
            log.info("site %s: the API server's clock agrees with the broker's again (within %.0f s)", self.site,
                     IGNORED_S)
            self._logged_s = None
        if abs(skew) < LOGGED_S:
            return
        if self._logged_s is not None and abs(skew - self._logged_s) < LOGGED_S:
            return
        self._logged_s = skew
        log.warning("site %s: the API server's clock is %s %s the broker's (by the Date of its answers); the "
                    "waits measured from the cluster's timestamps (unschedulable_after_s) are counted on the "
                    "cluster's clock. Check the hosts' time synchronisation (NTP)", self.site, _span(abs(skew)),
                    "ahead of" if skew > 0 else "behind")


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} minutes"
    return f"{seconds / 3600:.1f} hours"
