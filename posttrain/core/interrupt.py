"""Stop on SIGINT / SIGTERM at a step boundary, with a checkpoint: Ctrl-C, and the SIGTERM a TPU VM's
preemption sends, must not lose the work since the last checkpoint.

`on_signal()` is held around a training loop. The first signal only sets a flag (and says so on
stderr); the loop calls `stop_if_requested` at the end of each step, which saves a checkpoint at
that step (through the run's `Checkpointer`: the finite check included), waits for it to be on disk
and raises `Interrupted`. `posttrain.main` turns that into one line saying how to resume and the
exit status 128 + signal (130 for SIGINT, 143 for SIGTERM). A second signal aborts at once
(KeyboardInterrupt). The previous handlers are restored when the block ends, so runs inside a
test process leave no trace.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The run stopped on a signal after saving a checkpoint at `step` (None: no step was left to
    save, e.g. the signal came after the last one). A BaseException, like KeyboardInterrupt, so
    no `except Exception` on the way up treats it as an error of the run."""

    def __init__(self, signum: int, step: int | None, workdir: str | None):
        self.signum, self.step, self.workdir = signum, step, workdir
        where = f"checkpoint saved at step {step} in {workdir}" if step is not None else f"workdir {workdir}"
        super().__init__(f"stopped by {signal.Signals(signum).name}: {where}")

    @property
    def exit_code(self) -> int:
        """The shell's convention for a death by signal: 128 + its number."""
        return 128 + self.signum


class StopRequest:
    """The signal received so far (None: none). Set by the handler, read by the loop."""

    def __init__(self):
        self.signum: int | None = None

    def handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # the second signal: stop now, without a checkpoint
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: aborted")
        self.signum = signum
        sys.stderr.write(
            f"\n{signal.Signals(signum).name} received: finishing the current step and saving a "
            "checkpoint (send it again to abort at once)\n"
        )
        sys.stderr.flush()


_ACTIVE: StopRequest | None = None


@contextlib.contextmanager
def on_signal() -> Iterator[StopRequest]:
    """Catch SIGINT/SIGTERM for the block (see the module docstring); re-entrant (an inner block
    shares the outer one's request). Outside the main thread no handler can be installed and the
    signals keep their previous behaviour."""
    global _ACTIVE
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    if threading.current_thread() is not threading.main_thread():
        yield StopRequest()
        return
    request = StopRequest()
    previous = {s: signal.signal(s, request.handle) for s in SIGNALS}
    _ACTIVE = request
    try:
        yield request
    finally:
        _ACTIVE = None
        for s, handler in previous.items():
            signal.signal(s, handler)
    if request.signum is not None:  # came after the last step's check: the stage is done, stop here
        raise Interrupted(request.signum, None, None)


def requested() -> int | None:
    """The signal that asked the active block to stop, or None."""
    return _ACTIVE.signum if _ACTIVE is not None else None


def agreed(signum: int | None, step: int, every: int) -> int | None:
    """The signal every process acts on. One process: its own. Several (multi-host): a signal
    reaches the hosts at different steps, and a host that stops alone leaves the others waiting in
    a collective; so every `every` steps (the same steps on each host) they all-gather their flags
    and all stop if any got one."""
    import jax

    from posttrain.parallel.agreement import agree

    if jax.process_count() == 1:
        return signum
    if step % max(every, 1):
        return None
    return agree(signum or 0, name=f"stop signal at step {step}", reduce="max") or None


def stop_if_requested(
    step: int, *, saved: bool, save: Callable[[], None], ckpt, workdir: str, writer=None, agree_every: int = 1
) -> None:
    """At the end of a step (`step` updates done): if a signal asked to stop, save a checkpoint at
    `step` (unless the loop just `saved` one), wait until it is on disk, close `writer` (metrics),
    raise `Interrupted`. Multi-host runs agree on it every `agree_every` steps (see `agreed`)."""
    if _ACTIVE is None:
        return
    signum = agreed(requested(), step, agree_every)
    if signum is None:
        return
    if not saved:
        save()
    ckpt.wait()
    if writer is not None:
        writer.close()
    raise Interrupted(signum, step, workdir)
