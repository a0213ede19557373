"""Persistent sandboxed sessions: a working directory that lives across calls.

Every sandbox execution starts in a fresh private directory that is deleted afterwards (`core`).
A `Session` keeps an agent's working directory between its tool calls by carrying it: each call
runs in a new sandbox whose working directory is the session's files; a small driver inside the
sandbox runs the command (`sh -c` or `python -I -c`) with the call's time limit, then reports the
command's output and the directory's files (content and mode) back to the host, which keeps them
for the next call. What persists is the working directory -- files and their modes; not the
shell's variables, its current directory, or a Python interpreter's memory (each call is a new
process). Empty directories and symlinks are not kept (each call's result says which paths were
dropped).

The host's copy is the session's state, so `snapshot()` / `restore()` are exact and cheap: an
episode can be replayed from any call on. Limits: `Limits` per call (the sandbox's, with
`wall_s` bounding the command and `disk_bytes` the directory), and per session the number of
calls (`max_calls`), the bytes kept (`max_bytes`) and the files and directories kept
(`max_inodes`, by default half the working directory's inodes, so a check that adds its own files
to the state still fits); a call over a limit leaves the state as it was before the call. No name
the agent gives a file can stop the host: paths over `MAX_PATH_BYTES` or not UTF-8 are not kept
(the call's result lists them as skipped).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from collections.abc import Mapping

from posttrain.sandbox.core import Sandbox
from posttrain.sandbox.isolation import sandbox_python
from posttrain.sandbox.job import Job, Limits, Status

SESSION_TOOLS = ("sh", "python")
MAX_PATH_BYTES = 1024  # longest relative path a session keeps (the host's PATH_MAX is 4096 with the staging root)
DRIVER_SLACK_S = 10.0  # sandbox wall time beyond the command's limit: driver start-up and the state dump

# Runs inside the sandbox as `python -I -S -c DRIVER`; the request comes on stdin. Stdlib only.
DRIVER = r"""
import base64, json, os, select, signal, subprocess, sys, time
req = json.loads(sys.stdin.read())
for path, mode in req["modes"].items():
    os.chmod(path, mode)
argv = ["/bin/sh", "-c", req["code"]] if req["tool"] == "sh" else [sys.executable, "-E", "-s", "-c", req["code"]]
try:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
except (ValueError, OSError) as e:      # e.g. a NUL byte in the command
    proc = subprocess.Popen(["/bin/sh", "-c", 'printf "%s\\n" "$0"; exit 126', f"cannot run the command: {e}"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
fd, out, dropped, timed_out = proc.stdout.fileno(), bytearray(), 0, False
deadline = time.monotonic() + req["timeout"]
while True:
    ready = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
    if not ready:
        timed_out = True
        break
    chunk = os.read(fd, 65536)
    if not chunk:
        break
    keep = chunk[:max(0, req["max_output"] - len(out))]
    out += keep
    dropped += len(chunk) - len(keep)
if timed_out:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
code = proc.wait()
files, skipped = [], []
for root, dirs, names in os.walk("."):
    dirs.sort()
    for name in sorted(names):
        path = os.path.normpath(os.path.join(root, name))
        try:
            named = len(path.encode()) <= req["max_path"]
        except UnicodeEncodeError:       # bytes that are no UTF-8: no name the host keeps
            named = False
        if not named or os.path.islink(path) or not os.path.isfile(path):
            skipped.append(path.encode(errors="replace").decode()[:200])
            continue
        with open(path, "rb") as f:
            files.append([path, base64.b64encode(f.read()).decode(), os.stat(path).st_mode & 0o7777])
sys.stdout.write(json.dumps({"exit": None if timed_out else code, "output": base64.b64encode(bytes(out)).decode(),
                             "dropped": dropped, "files": files, "skipped": skipped}))
"""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A session's working directory at one moment: (path, content, mode) per file, sorted."""

    files: tuple[tuple[str, bytes, int], ...]

    @classmethod
    def of(cls, files: Mapping[str, str | bytes], modes: Mapping[str, int] | None = None) -> Snapshot:
        """A snapshot of `files` (relative path -> content), mode 0o644 unless `modes` says."""
        modes = modes or {}
        return cls(
            tuple(
                sorted(
                    (p, c.encode() if isinstance(c, str) else bytes(c), modes.get(p, 0o644)) for p, c in files.items()
                )
            )
        )

    def as_dict(self) -> dict[str, bytes]:
        """The files as {path: content}."""
        return {p: c for p, c, _ in self.files}

    @property
    def num_bytes(self) -> int:
        """Total size of the files' contents."""
        return sum(len(c) for _, c, _ in self.files)

    @property
    def num_inodes(self) -> int:
        """Files and the directories that hold them: the inodes the directory takes."""
        dirs = {p.rsplit("/", i)[0] for p, _, _ in self.files for i in range(1, p.count("/") + 1)}
        return len(self.files) + len(dirs)


@dataclasses.dataclass(frozen=True)
class CallResult:
    """One call: what the command printed (stdout and stderr interleaved, cut to the session's
    `max_output_bytes`; `dropped` bytes beyond), its status (PASS: exit 0; FAIL: non-zero exit;
    TIMEOUT; LIMIT_EXCEEDED: a call/session limit, `limit` says which; ERROR: the sandbox itself
    failed), the exit code, the paths not kept (symlinks, special files) and the wall time."""

    output: bytes
    status: Status
    exit_code: int | None = None
    limit: str | None = None
    dropped: int = 0
    skipped: tuple[str, ...] = ()
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the command ran and exited 0."""
        return self.status is Status.PASS


def _parse_report(stdout: bytes) -> tuple[dict, Snapshot, bytes] | None:
    """The driver's report (`DRIVER`), checked: every path relative and inside the directory
    (and a name a file can have), modes in range, contents base64. None when it is not such a
    report (a program inside the sandbox can write to the driver's stdout, so the host trusts
    nothing it did not check)."""
    try:
        rep = json.loads(stdout)
        files = []
        for path, content, mode in rep["files"]:
            parts = path.split("/")
            if not isinstance(path, str) or path.startswith("/") or ".." in parts or "" in parts or "." in parts:
                return None
            if "\0" in path or len(path.encode()) > MAX_PATH_BYTES or any(len(p.encode()) > 255 for p in parts):
                return None  # no file has such a name, or the driver would have skipped it
            if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
                return None
            files.append((path, base64.b64decode(content, validate=True), mode))
        output = base64.b64decode(rep["output"], validate=True)
        if not (rep["exit"] is None or isinstance(rep["exit"], int)) or not isinstance(rep["dropped"], int):
            return None
        rep["skipped"] = [str(p) for p in rep["skipped"]]
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):  # Recursion: JSON nested deep
        return None
    paths = {p for p, _, _ in files}
    if len(paths) < len(files) or any(p.rsplit("/", i)[0] in paths for p in paths for i in range(1, p.count("/") + 1)):
        return None  # a path twice, or a file where a directory is: no directory looks like that
    return rep, Snapshot(tuple(sorted(files))), output


class Session:
    """A persistent working directory on `sandbox` (see the module docstring).

    files: the directory's initial contents; limits: per call (None: the sandbox's); max_calls
    max_bytes and max_inodes: per session (max_inodes None: half of `limits.inodes`);
    max_output_bytes: how much of a command's output is kept.
    """

    def __init__(
        self,
        sandbox: Sandbox,
        files: Mapping[str, str | bytes] | Snapshot = Snapshot(()),
        *,
        limits: Limits | None = None,
        max_calls: int = 32,
        max_bytes: int = 1 << 20,
        max_inodes: int | None = None,
        max_output_bytes: int = 16 << 10,
    ) -> None:
        if max_calls < 1 or max_bytes < 1 or max_output_bytes < 1:
            raise ValueError(
                f"Session: max_calls ({max_calls}), max_bytes ({max_bytes}) and max_output_bytes "
                f"({max_output_bytes}) must be positive"
            )
        self.sandbox, self.limits = sandbox, limits or sandbox.limits
        self.max_calls, self.max_bytes, self.max_output_bytes = max_calls, max_bytes, max_output_bytes
        self.max_inodes = self.limits.inodes // 2 if max_inodes is None else max_inodes
        self.calls = 0
        self._state = files if isinstance(files, Snapshot) else Snapshot.of(files)
        if self._state.num_inodes > self.max_inodes:
            raise ValueError(
                f"Session: the initial files take {self._state.num_inodes} inodes, over max_inodes={self.max_inodes}"
            )
        if self._state.num_bytes > max_bytes:
            raise ValueError(
                f"Session: the initial files hold {self._state.num_bytes} bytes, over max_bytes={max_bytes}"
            )

    def snapshot(self) -> Snapshot:
        """The working directory now (immutable: later calls do not change it)."""
        return self._state

    def restore(self, snap: Snapshot) -> None:
        """Make `snap` the working directory (the call count is not reset)."""
        self._state = snap

    def run(self, tool: str, code: str) -> CallResult:
        """Run `code` with `tool` ("sh": /bin/sh -c, "python": python -E -s -c, so the directory is
        importable) in the working directory; the files it leaves become the session's state (unless
        a limit was hit)."""
        if tool not in SESSION_TOOLS:
            raise ValueError(f"Session.run: unknown tool {tool!r}; expected one of {SESSION_TOOLS}")
        if self.calls >= self.max_calls:
            return CallResult(f"session limit: {self.max_calls} calls".encode(), Status.LIMIT_EXCEEDED, limit="calls")
        self.calls += 1
        lim = self.limits
        state_bytes = 4 * max(lim.disk_bytes, self.max_bytes) // 3 + 4 * self.max_output_bytes // 3 + (64 << 10)
        job_limits = dataclasses.replace(
            lim, wall_s=lim.wall_s + DRIVER_SLACK_S, output_bytes=max(lim.output_bytes, state_bytes)
        )
        request = {
            "tool": tool,
            "code": code,
            "timeout": lim.wall_s,
            "max_output": self.max_output_bytes,
            "max_path": MAX_PATH_BYTES,
            "modes": {p: m for p, _, m in self._state.files},
        }
        t0 = time.perf_counter()
        res = self.sandbox.run(
            Job(
                (sandbox_python(), "-I", "-S", "-c", DRIVER),
                files=self._state.as_dict(),
                stdin=json.dumps(request).encode(),
                limits=job_limits,
            )
        )
        wall = time.perf_counter() - t0
        if res.status is not Status.PASS:  # the driver did not finish: the call's effects are lost
            why = res.error or (res.stderr.decode(errors="replace")[-300:] or res.status.value)
            status = res.status if res.status in (Status.ERROR, Status.TIMEOUT, Status.LIMIT_EXCEEDED) else Status.CRASH
            return CallResult(
                f"call failed ({res.status.value}{', ' + res.limit if res.limit else ''}): {why}".encode(),
                status,
                limit=res.limit,
                wall_s=wall,
            )
        parsed = _parse_report(res.stdout)
        if parsed is None:  # the command wrote into the driver's own stdout: treat like a crash
            return CallResult(
                b"call failed: the session report was unreadable (did the command write to its parent's output?)",
                Status.CRASH,
                wall_s=wall,
            )
        rep, new, output = parsed
        over = [
            (limit, held, most)
            for limit, held, most in (
                ("bytes", new.num_bytes, self.max_bytes),
                ("inodes", new.num_inodes, self.max_inodes),
            )
            if held > most
        ]
        if over:
            limit, held, most = over[0]
            note = f"\n[session limit: the working directory would hold {held} {limit} > {most}; "
            note += "this call's changes were undone]"
            return CallResult(
                output + note.encode(),
                Status.LIMIT_EXCEEDED,
                rep["exit"],
                limit,
                rep["dropped"],
                tuple(rep["skipped"]),
                wall,
            )
        self._state = new
        code = rep["exit"]
        status = Status.TIMEOUT if code is None else Status.PASS if code == 0 else Status.FAIL
        return CallResult(
            output, status, code, "wall" if code is None else None, rep["dropped"], tuple(rep["skipped"]), wall
        )
