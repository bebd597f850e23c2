"""The steps of the last minutes, second by second: how many, how long they took, and the tokens they gave, for the
status route's charts. No MLX.

Why here and not from the Prometheus counters: a page opened now should see the minutes before it, and a scrape's
counters hold only totals since the process started.
"""

from __future__ import annotations

import time
from collections import deque

KEPT_S = 300


class Recent:
    """Per-second sums over the last ``kept`` seconds: ``[second, steps, step seconds, tokens]``."""

    def __init__(self, kept: int = KEPT_S) -> None:
        self.kept = kept
        self._seconds: deque[list[float]] = deque(maxlen=kept)

    def add(self, seconds: float, tokens: int, now: float | None = None) -> None:
        second = float(int(time.time() if now is None else now))
        if self._seconds and self._seconds[-1][0] == second:
            bucket = self._seconds[-1]
            bucket[1] += 1
            bucket[2] += seconds
            bucket[3] += tokens
        else:
            self._seconds.append([second, 1, seconds, tokens])

    def seconds(self, now: float | None = None) -> list[list[float]]:
        """The seconds with steps among the last ``kept``, oldest first (a second without one is left out)."""
        since = int(time.time() if now is None else now) - self.kept
        return [list(bucket) for bucket in self._seconds if bucket[0] > since]
