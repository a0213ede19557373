"""A daemon thread that calls a function every few seconds until stopped: the sampler's heartbeat
(`liveness.Heartbeat`) and the learner's weight server (`transfer.WeightServer`) both run on one."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Ticker:
    """Calls `tick` every `every_s` seconds on a daemon thread named `name`, from `start` to `stop`
    (the first call `every_s` after `start`)."""

    def __init__(self, tick: Callable[[], object], every_s: float, name: str) -> None:
        self.tick, self.every_s = tick, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> None:
        """Start the thread, unless it runs already."""
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self, join_s: float = 0.0) -> None:
        """Stop ticking; with `join_s`, wait up to that long for a tick under way to end."""
        self._stop.set()
        if join_s and self._thread.is_alive():
            self._thread.join(join_s)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.tick()
