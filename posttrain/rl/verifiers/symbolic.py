"""Symbolic answer equivalence (math-verify / sympy) in a child process, with a real timeout.

math-verify's own timeouts use SIGALRM, which works only in the main thread; verifier pools run
checks on other threads, and sympy can compute for minutes on inputs like
`(x+1)^{2000}-(x+2)^{2000}`. A Python thread cannot be stopped, so the check runs in a separate
process that the calling thread waits on for `timeout` seconds, then kills (and restarts on the
next call). A timeout or an exception inside math-verify is raised to the caller as
`SymbolicCheckError`, never turned into a verdict.
"""

from __future__ import annotations

import multiprocessing
import threading
from multiprocessing.connection import Connection

STARTUP_TIMEOUT_S = 120.0  # spawning the worker and importing sympy, on a loaded machine


class SymbolicCheckError(RuntimeError):
    """A symbolic check that failed (an exception in math-verify) or ran out of time."""


def _serve(conn: Connection) -> None:
    """Worker process: answer (pred, ref) requests with ("ok", bool) or ("error", message)."""
    import logging
    import signal

    # Ctrl-C reaches the terminal's whole process group: the parent decides (finish the step, save,
    # stop: train/interrupt.py) and closes this worker; dying here would fail the step's checks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": ours is outside
    # sympy imports much of itself on first use: pay that before the first timed check
    verify(parse("$(x+1)^2$", parsing_timeout=None), parse("$x^2+2x+1$", parsing_timeout=None), timeout_seconds=None)
    conn.send("ready")
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent closed its end (it exited): nothing left to answer
            return
        if request is None:
            return
        try:
            gold, guess = (
                parse(s if s.strip().startswith("$") else f"${s}$", parsing_timeout=None, raise_on_error=True)
                for s in (request[1], request[0])
            )
            conn.send(("ok", bool(gold and guess and verify(gold, guess, timeout_seconds=None, raise_on_error=True))))
        except Exception as e:  # reported to the caller, who raises it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class SymbolicChecker:
    """One worker process for `equal(pred, ref)`, shared by the calling threads (one check at a
    time); each check may take at most `timeout` seconds after the worker has started."""

    def __init__(self, timeout: float = 5.0) -> None:
        if timeout <= 0:
            raise ValueError(f"symbolic check timeout={timeout}: expected > 0 seconds")
        self.timeout = timeout
        self._lock = threading.Lock()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def equal(self, pred: str, ref: str) -> bool:
        """Whether math-verify finds `pred` and `ref` equivalent; SymbolicCheckError on an
        exception inside math-verify, a timeout or a dead worker."""
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            try:
                self._conn.send((pred, ref))
                if not self._conn.poll(self.timeout):
                    self._stop()
                    raise SymbolicCheckError(
                        f"symbolic check timed out after {self.timeout:g} s: {str(pred)[:80]!r} vs {str(ref)[:80]!r}"
                    )
                status, value = self._conn.recv()
            except (EOFError, OSError):
                self._stop()
                raise SymbolicCheckError(
                    f"symbolic check worker died on {str(pred)[:80]!r} vs {str(ref)[:80]!r}"
                ) from None
        if status == "error":
            raise SymbolicCheckError(f"math-verify failed on {str(pred)[:80]!r} vs {str(ref)[:80]!r}: {value}")
        return value

    def close(self) -> None:
        """Stop the worker process (a later `equal` starts a new one)."""
        with self._lock:
            self._stop()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork: the parent runs JAX threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="symbolic-check")
        self._proc.start()
        child.close()
        try:
            ready = self._conn.poll(STARTUP_TIMEOUT_S) and self._conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._stop()
            raise SymbolicCheckError(f"symbolic check worker did not start within {STARTUP_TIMEOUT_S:g} s")

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None
