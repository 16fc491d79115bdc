"""Rank 0's progress lines: at each evaluation its scores, and between evaluations a heartbeat at most every few
seconds that says a long run is alive; every line ends with the pace (rounds per second since the start, elapsed
time, ETA), so when a run will end shows whatever ``eval_every`` is."""

from __future__ import annotations

import time


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Heartbeat:
    """Rank 0's progress lines (``every_s`` 0: no heartbeat between evaluations)."""

    def __init__(self, every_s: float, first_round: int, rounds: int):
        self.every_s, self.first_round, self.rounds = every_s, first_round, rounds
        self.started = self.last_line = time.monotonic()

    def report(self, round_: int, evaluation_line: str | None) -> None:
        """After ``round_``: print its evaluation's progress line if it has one, else a heartbeat when one is due
        (the next heartbeat is due ``every_s`` after either); either ends with the pace."""
        line = evaluation_line or self.line(round_)
        if line is not None:
            print(line if line is not evaluation_line else f"{line} | {self.pace(round_)}", flush=True)
            self.last_line = time.monotonic()

    def line(self, round_: int) -> str | None:
        """The heartbeat after ``round_``, or ``None`` when none is due."""
        if self.every_s <= 0 or time.monotonic() - self.last_line < self.every_s:
            return None
        return f"round {round_:>{len(str(self.rounds))}}/{self.rounds} | {self.pace(round_)}"

    def pace(self, round_: int) -> str:
        """Rounds per second since this start (or resume), elapsed time and the ETA of the last round."""
        elapsed = time.monotonic() - self.started
        rate = (round_ - self.first_round + 1) / elapsed if elapsed > 0 else 0.0
        eta = _clock((self.rounds - round_) / rate) if rate > 0 else "?"
        return f"{rate:.3g} rounds/s | elapsed {_clock(elapsed)} | ETA {eta}"
