"""Symbolic answer equivalence (math-verify / sympy) in a child process, with a real timeout.

math-verify's own timeouts use SIGALRM, which works only in the main thread; verifier pools run
checks on other threads, and sympy can compute for minutes on inputs like
`(x+1)^{2000}-(x+2)^{2000}`. A Python thread cannot be stopped, so the check runs in a separate
process that the calling thread waits on for `timeout` seconds, then kills (and restarts on the
next call). A timeout or an exception inside math-verify is raised to the caller as
`SymbolicCheckError`, never turned into a verdict.

The worker (`symbolic_worker.py`) is a plain subprocess of this interpreter speaking line JSON on
its stdin/stdout, not a multiprocessing "spawn" child: spawn re-imports the caller's `__main__`,
so a script that scores answers at its top level ran twice (and its worker failed to start).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

STARTUP_TIMEOUT_S = 120.0  # starting the worker and importing sympy, on a loaded machine
_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding this `posttrain` package
_BOOT = f"import sys; sys.path.insert(0, {_ROOT!r}); from posttrain.rl.verifiers.symbolic_worker import main; main()"


class SymbolicCheckError(RuntimeError):
    """A symbolic check that failed (an exception in math-verify) or ran out of time."""


class SymbolicChecker:
    """One worker process for `equal(pred, ref)`, shared by the calling threads (one check at a
    time); each check may take at most `timeout` seconds after the worker has started."""

    def __init__(self, timeout: float = 5.0) -> None:
        if timeout <= 0:
            raise ValueError(f"symbolic check timeout={timeout}: expected > 0 seconds")
        self.timeout = timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""

    def equal(self, pred: str, ref: str, *, reduced: bool = False) -> bool:
        """Whether math-verify finds `pred` and `ref` equivalent (and, `reduced`, `pred` is no
        quotient with a common factor left to cancel); SymbolicCheckError on an exception inside
        math-verify, a timeout or a dead worker."""
        request = {"pred": pred, "ref": ref, **({"reduced": True} if reduced else {})}
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
                reply = self._read_line(self.timeout)
            except (EOFError, OSError, ValueError):
                self._stop()
                raise SymbolicCheckError(
                    f"symbolic check worker died on {str(pred)[:80]!r} vs {str(ref)[:80]!r}"
                ) from None
            if reply is None:
                self._stop()
                raise SymbolicCheckError(
                    f"symbolic check timed out after {self.timeout:g} s: {str(pred)[:80]!r} vs {str(ref)[:80]!r}"
                )
        if "error" in reply:
            raise SymbolicCheckError(f"math-verify failed on {str(pred)[:80]!r} vs {str(ref)[:80]!r}: {reply['error']}")
        return bool(reply["ok"])

    def close(self) -> None:
        """Stop the worker process (a later `equal` starts a new one)."""
        with self._lock:
            self._stop()

    def _read_line(self, timeout: float) -> dict | None:
        """The worker's next reply, None after `timeout` seconds; EOFError when it has exited."""
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError("symbolic check worker exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _start(self) -> None:
        self._buffer = b""
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        try:
            reply = self._read_line(STARTUP_TIMEOUT_S)
            why = None if reply == {"ready": True} else f"did not start within {STARTUP_TIMEOUT_S:g} s"
        except (EOFError, OSError, ValueError):
            try:
                why = f"exited with status {self._proc.wait(10)} while starting (its error is on stderr)"
            except subprocess.TimeoutExpired:
                why = "closed its output while starting"
        if why is not None:
            self._stop()
            raise SymbolicCheckError(f"symbolic check worker {why}")

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
        self._proc = None
        self._buffer = b""
