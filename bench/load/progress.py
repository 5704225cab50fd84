"""Progress lines on stderr while a load run works: a long run (the shipped target on a CPU takes
tens of minutes) says how far it is instead of sitting silent."""

from __future__ import annotations

import sys
import threading
import time

from drafter.client import VerifierClient

INTERVAL_S = 15.0


def say(message: str, tag: str = "load") -> None:
    print(f"[{tag}] {message}", file=sys.stderr, flush=True)


class StepProgress:
    """While open, every `interval_s` prints the server's verify steps since entry against `total`
    (GetStats over its own channel, so the caller's client is untouched).

        with StepProgress(address, total=64 * 300, label="load"):
            ...  # the drafter processes run
    """

    def __init__(self, address: str, total: int, label: str, interval_s: float = INTERVAL_S, tag: str = "load"):
        self.address, self.total, self.label, self.interval_s, self.tag = address, total, label, interval_s, tag
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        started = time.monotonic()
        try:
            with VerifierClient(self.address, timeout_s=10.0) as client:
                first = client.stats()
                while not self._stop.wait(self.interval_s):
                    now = client.stats()
                    steps = now.steps - first.steps
                    say(f"{self.label}: {steps}/{self.total} steps, {now.errors - first.errors} errors, "
                        f"{now.open_sessions} sessions open, {time.monotonic() - started:.0f} s", self.tag)
        except Exception as exc:  # progress is a courtesy: a failed poll must not end the run
            say(f"{self.label}: progress stopped ({exc!r})", self.tag)

    def __enter__(self) -> "StepProgress":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 15.0)
