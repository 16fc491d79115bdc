"""The heartbeat: between evaluations, a line at most every few seconds that says a long run is alive and when
it will end (round, rounds per second, elapsed time, ETA), independent of ``eval_every``."""

from __future__ import annotations

import time


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Heartbeat:
    """Rank 0's progress between evaluations (``every_s`` 0: none)."""

    def __init__(self, every_s: float, first_round: int, rounds: int):
        self.every_s, self.first_round, self.rounds = every_s, first_round, rounds
        self.started = self.last_line = time.monotonic()

    def report(self, round_: int, evaluation_line: str | None) -> None:
        """After ``round_``: print its evaluation's progress line if it has one, else a heartbeat when one is due
        (the next heartbeat is due ``every_s`` after either)."""
        line = evaluation_line or self.line(round_)
        if line is not None:
            print(line, flush=True)
            self.last_line = time.monotonic()

    def line(self, round_: int) -> str | None:
        """The heartbeat after ``round_``, or ``None`` when none is due."""
        now = time.monotonic()
        if self.every_s <= 0 or now - self.last_line < self.every_s:
            return None
        self.last_line = now
        elapsed = now - self.started
        done = round_ - self.first_round + 1
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = _clock((self.rounds - round_) / rate) if rate > 0 else "?"
        width = len(str(self.rounds))
        return (f"round {round_:>{width}}/{self.rounds} | {rate:.3g} rounds/s | elapsed {_clock(elapsed)} | "
                f"ETA {eta}")
