"""Trusted test harness that runs *inside* the sandbox (stdlib only; run as `python -I -c <file>`).

Why two processes: untrusted code that shares an interpreter with the checks can patch
anything (builtins, `AssertionError`, the harness's own functions), read any secret in memory,
or exit early. So the harness (process B) first marks itself non-dumpable, so that a process of
the same uid can neither ptrace it nor open its /proc files, then forks the *solution process*
(A) before it has read anything secret. A runs the untrusted program and answers calls over a
socket. Only then does B read its payload from stdin: a per-run token, the pristine tests and
the setup code (the task prompt, trusted). B runs the tests with every tested function
replaced by a proxy that calls into A and rebuilds the reply with an unpickler that only
builds plain data (no user classes, so no `__eq__` tricks). A's stdout and stderr go to B's
stderr; B alone writes stdout: "<token> PASS" or "<token> FAIL <reason>" after the checks.
"""

import builtins
import ctypes
import io
import json
import os
import pickle
import signal
import socket
import struct
import sys

PR_SET_DUMPABLE = 4
MAX_MESSAGE = 64 << 20
_HEADER = struct.Struct(">Q")
_PLAIN = {
    "builtins": {
        "complex",
        "set",
        "frozenset",
        "bytearray",
        "range",
        "slice",
        "int",
        "float",
        "str",
        "bytes",
        "bool",
        "list",
        "tuple",
        "dict",
    },
    "collections": {"OrderedDict", "Counter", "deque", "defaultdict"},
    "fractions": {"Fraction"},
    "decimal": {"Decimal"},
}


def send(sock, obj):
    """Write one length-prefixed pickle."""
    data = pickle.dumps(obj, protocol=5)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_bytes(sock):
    """Read one length-prefixed message (refusing oversized ones)."""
    header = _recv_exact(sock, _HEADER.size)
    (size,) = _HEADER.unpack(header)
    if size > MAX_MESSAGE:
        raise RuntimeError(f"solution process sent {size} bytes (limit {MAX_MESSAGE})")
    return _recv_exact(sock, size)


def _recv_exact(sock, size):
    """Exactly `size` bytes, or an error when the peer is gone."""
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise RuntimeError("solution process exited before answering")
        chunks += chunk
    return bytes(chunks)


class PlainUnpickler(pickle.Unpickler):
    """Builds only plain data: containers, numbers, strings and a few stdlib value types."""

    def find_class(self, module, name):
        if name in _PLAIN.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"solution returned a {module}.{name}, not plain data")


def plain_loads(data):
    """Unpickle untrusted bytes into plain data only."""
    return PlainUnpickler(io.BytesIO(data)).load()


def serve(sock):
    """Solution process: run the untrusted program, then answer ("call", name, args, kwargs)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdout.reconfigure(line_buffering=True)  # B kills A at the end: flush as it goes
    program = pickle.loads(recv_bytes(sock))
    namespace = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        exec(compile(program, "solution.py", "exec"), namespace)
    except BaseException as e:
        send(sock, ("load_error", f"{type(e).__name__}: {e}"))
        os._exit(1)
    send(sock, ("ready",))
    while True:
        name, args, kwargs = pickle.loads(recv_bytes(sock))
        try:
            reply = ("ok", namespace[name](*args, **kwargs))
        except BaseException as e:
            reply = ("raise", type(e).__name__, str(e)[:1000])
        try:
            send(sock, reply)
        except Exception as e:
            send(sock, ("raise", "TypeError", f"{name} returned something that is not plain data: {e}"))


def make_proxy(sock, name):
    """A stand-in for the solution's function `name` whose results are plain data."""

    def proxy(*args, **kwargs):
        send(sock, (name, args, kwargs))
        reply = plain_loads(recv_bytes(sock))
        if reply[0] == "ok":
            return reply[1]
        exc = getattr(builtins, str(reply[1]), None)
        if not (isinstance(exc, type) and issubclass(exc, Exception)):
            exc = RuntimeError
        raise exc(f"{name} raised {reply[1]}: {reply[2]}")

    proxy.__name__ = name
    return proxy


def run_tests(sock, payload):
    """Raise unless every check passes."""
    status = plain_loads(recv_bytes(sock))
    if status[0] != "ready":
        raise RuntimeError(f"solution failed to load: {status[1] if len(status) > 1 else status}")
    namespace = {"__name__": "__test__", "__builtins__": builtins}
    exec(compile(payload["setup"], "prompt.py", "exec"), namespace)
    for name in payload["functions"]:
        namespace[name] = make_proxy(sock, name)
    exec(compile(payload["test"], "test.py", "exec"), namespace)
    entry = payload["entry_point"]
    if entry is not None and "check" in namespace:
        namespace["check"](namespace[entry])


def main():
    """Harness process: fork the solution process, then run the checks and print the verdict."""
    if ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_DUMPABLE, 0) failed")
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            serve(theirs)
        finally:
            os._exit(1)
    theirs.close()
    payload = json.loads(sys.stdin.buffer.read())
    try:
        send(ours, payload["program"])
        run_tests(ours, payload)
        verdict = "PASS"
    except BaseException as e:
        verdict = f"FAIL {type(e).__name__}: {e}".replace("\n", " ")[:500]
    os.kill(pid, signal.SIGKILL)
    os.write(1, f"{payload['token']} {verdict}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    main()
