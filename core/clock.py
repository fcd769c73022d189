"""The one source of time for the engine, its schedulers and the benchmark.

Engine-path code never reads ``time.*``: it asks the engine's clock. ``WallClock`` is
real time (``time.perf_counter``); ``VirtualClock`` starts at 0 and moves only when told,
which is how ``executor=simulated`` runs hours of serving in seconds.
"""

from __future__ import annotations

import abc
import time


class Clock(abc.ABC):
    """Seconds on a monotonic clock."""

    @abc.abstractmethod
    def now(self) -> float:
        """The current time, seconds."""

    @abc.abstractmethod
    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass (a virtual clock jumps ahead)."""

    @property
    def is_virtual(self) -> bool:
        """True when time moves only through ``sleep``/``advance_to``."""
        return False

    def advance_to(self, moment: float) -> None:
        """Let time pass until ``moment`` (nothing when it has passed)."""
        self.sleep(max(0.0, moment - self.now()))


class WallClock(Clock):
    """Real time: ``time.perf_counter`` seconds."""

    now = staticmethod(time.perf_counter)
    """``time.perf_counter()`` itself: reading the wall clock costs no Python call."""

    def sleep(self, seconds: float) -> None:
        """``time.sleep``."""
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock(Clock):
    """Simulated time: starts at ``start`` and advances only by ``sleep``/``advance_to``."""

    def __init__(self, start: float = 0.0):
        self._now = start

    @property
    def is_virtual(self) -> bool:
        """Always True."""
        return True

    def now(self) -> float:
        """The simulated time."""
        return self._now

    def sleep(self, seconds: float) -> None:
        """Jump ahead by ``seconds``."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: sleep({seconds})")
        self._now += seconds
