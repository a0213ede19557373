"""Sandbox launcher: the first process of every sandboxed execution (see `core.py`).

Run as `python -I -S -c <this file's source> <spec json>` (stdlib only, small imports, never
imported by the host). It enters the namespaces, makes every mount read-only and the working
directory a private tmpfs -- with a private root, inside a new root filesystem that holds only
the visible system paths, a minimal /dev and the working directory -- then waits until the
host has moved it into the run's memory cgroup (if any) and forks init (pid 1 of the new PID
namespace), which forks the program, applies the resource limits, drops to the sandbox uid
and execs it. Init reports the program's exit status (or any setup error) as JSON lines on the
private status pipe `spec["status_fd"]`; setup failures exit with `spec["infra_exit"]`.
"""

import ctypes
import errno
import json
import os
import re
import resource
import signal
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWIPC = 0x8000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
KEEP = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, MNT_DETACH = 1, 38, 2
DEVICES = ("null", "zero", "full", "random", "urandom")
INNER_ID = 1000  # uid/gid inside a user namespace


def report(status_fd, **fields):
    """Send one JSON status line to the host (atomic: one pipe write)."""
    try:
        os.write(status_fd, (json.dumps(fields) + "\n").encode())
    except OSError:
        pass  # the host is gone or killed us; nobody to tell


def check(rc, what):
    """Raise OSError with errno's message when a libc call failed."""
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src, target, fstype, flags, data=None):
    """mount(2) through libc."""
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def enter_namespaces(ns):
    """Unshare the namespaces switched on in `ns`; map our uid/gid inside a user namespace."""
    flags = (
        (CLONE_NEWUSER if ns["user"] else 0)
        | (CLONE_NEWNET if ns["net"] else 0)
        | (CLONE_NEWPID if ns["pid"] else 0)
        | (CLONE_NEWNS if ns["mount"] else 0)
        | (CLONE_NEWIPC if ns["ipc"] else 0)
    )
    uid, gid = os.getuid(), os.getgid()
    if flags:
        check(libc.unshare(flags), "unshare")
    if ns["user"]:
        maps = (("setgroups", "deny"), ("uid_map", f"{INNER_ID} {uid} 1"), ("gid_map", f"{INNER_ID} {gid} 1"))
        for name, text in maps:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def readonly_mounts():
    """Make every mount of the (private) mount namespace read-only, keeping its other flags."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in rows:
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), row[4])
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for opt in row[5].split(","):
            flags |= KEEP.get(opt, 0)
        try:
            mount(None, target, None, flags)
        except OSError as e:  # a mount point the program cannot reach either
            if e.errno not in (13, 2) or target == "/":
                raise


class NoRoom(Exception):
    """The job's files do not fit in its working directory (bytes or inodes): the job's limit, not a fault."""


def private_workdir(workdir, staging_fd, uid, gid, size, inodes, root=""):
    """Mount a size-limited tmpfs over workdir (below `root`), copy the staged files into it,
    and give the program a private /dev/shm."""
    opts = f"size={size},nr_inodes={inodes},mode=0700,uid={uid},gid={gid}"
    shm = root + "/dev/shm"
    workdir = root + workdir
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    src = f"/proc/self/fd/{staging_fd}"
    try:
        for here, dirs, files in os.walk(src):
            rel = os.path.relpath(here, src)
            dst = os.path.normpath(os.path.join(workdir, rel))
            for d in dirs:
                os.mkdir(os.path.join(dst, d), 0o700)
                os.chown(os.path.join(dst, d), uid, gid)
            for name in files:
                with open(os.path.join(here, name), "rb") as fin, open(os.path.join(dst, name), "wb") as fout:
                    fout.write(fin.read())
                os.chown(os.path.join(dst, name), uid, gid)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoRoom(f"the job's files do not fit in {size} bytes and {inodes} inodes: {e}") from e
        raise
    if os.path.isdir(shm):
        mount("tmpfs", shm, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")


def build_root(root, visible, workdir, host_proc):
    """Make `root` (a fresh tmpfs) a root filesystem holding only the `visible` host paths
    (bound read-only: every host mount is read-only by now, and binds keep that), the basic
    devices, mount points for /proc and /dev/shm and the working directory."""
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path in visible:
        dst = root + path
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), dst)
            continue
        if os.path.isdir(path):
            os.mkdir(dst)
        else:
            open(dst, "w").close()
        mount(path, dst, None, MS_BIND | MS_REC)
    os.makedirs(root + "/dev/shm")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{root}/dev/{name}", "w").close()
            mount("/dev/" + name, f"{root}/dev/{name}", None, MS_BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", root + "/dev/fd")
    os.mkdir(root + "/proc")
    if host_proc:  # no PID namespace: no private /proc to mount later
        mount("/proc", root + "/proc", None, MS_BIND | MS_REC)
    os.makedirs(root + workdir)


def enter_root(root):
    """Make the built root the filesystem root (read-only) and drop the host's from this
    namespace altogether, so no path leads back to it."""
    mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    check(libc.pivot_root(b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def exec_program(spec, init_pid, uid, gid):
    """In init's child: apply the limits, drop to the sandbox uid, exec the program."""
    lim = spec["limits"]
    status_fd = spec["status_fd"]
    for res, value in (
        (resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),
        (resource.RLIMIT_AS, (lim["memory_bytes"],) * 2),
        (resource.RLIMIT_NPROC, (lim["processes"],) * 2),
        (resource.RLIMIT_FSIZE, (lim["file_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (lim["open_files"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(res, value)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")  # setuid binaries stay unprivileged
    if spec["drop_uid"]:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    if os.getppid() != init_pid:
        os._exit(spec["infra_exit"])
    if spec["ns"]["pid"]:
        # Own session: kill(0) must not reach the launcher outside the PID namespace (in a user
        # namespace it has the program's host uid). Without one, the host's group kill needs the group.
        os.setsid()
    os.chdir(spec["workdir"])
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these, and exec keeps ignored signals
        signal.signal(sig, signal.SIG_DFL)
    os.set_inheritable(status_fd, False)  # closed by execve, open until then for errors
    os.closerange(3, status_fd)
    os.closerange(status_fd + 1, 1 << 16)
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def run_init(spec, alive_r, uid, gid, root):
    """Init (pid 1 of the PID namespace): mount its /proc, enter the private root (after the
    /proc mount: in a user namespace a new proc may only be mounted while the host's is still
    visible), fork the program, reap everything, report its exit."""
    infra = spec["infra_exit"]
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    os.set_blocking(alive_r, False)
    try:
        if os.read(alive_r, 1) == b"":
            os._exit(infra)  # the launcher died before the death signal was armed
    except BlockingIOError:
        pass
    if spec["ns"]["pid"] and spec["ns"]["mount"]:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if root:
        enter_root(root)
    init_pid = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            exec_program(spec, init_pid, uid, gid)
        except BaseException as e:
            report(spec["status_fd"], error=f"exec {spec['argv'][0]}: {e}")
        finally:
            os._exit(infra)
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == child:
            report(spec["status_fd"], exit=os.waitstatus_to_exitcode(status), cpu_s=usage.ru_utime + usage.ru_stime)
            os._exit(0)


def main(spec):
    """Set up the namespaces and mounts, fork init, and exit with init's exit code."""
    infra = spec["infra_exit"]
    try:
        ns = spec["ns"]
        staging_fd = os.open(spec["workdir"], os.O_RDONLY | os.O_DIRECTORY)
        enter_namespaces(ns)
        uid, gid = (INNER_ID, INNER_ID) if ns["user"] else (spec["uid"], spec["gid"])
        # The new root is built on the staging directory's path (its files stay readable via staging_fd).
        root = spec["workdir"] if ns["mount"] and spec["root"] is not None else ""
        if ns["mount"]:
            readonly_mounts()
            if root:
                build_root(root, spec["root"], spec["workdir"], host_proc=not ns["pid"])
            private_workdir(spec["workdir"], staging_fd, uid, gid, spec["limits"]["disk_bytes"], spec["inodes"], root)
        os.close(staging_fd)
        if spec["go_fd"] is not None:  # the host moves us into the run's memory cgroup meanwhile
            if os.read(spec["go_fd"], 1) != b"1":
                raise OSError("the host did not move the launcher into the run's memory cgroup")
            os.close(spec["go_fd"])
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(alive_w)
            try:
                run_init(spec, alive_r, uid, gid, root)
            except BaseException as e:
                report(spec["status_fd"], error=f"init: {e}")
            finally:
                os._exit(infra)
        os.close(alive_r)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else infra)
    except NoRoom as e:
        report(spec["status_fd"], limit="disk", detail=str(e))
        os._exit(infra)
    except BaseException as e:
        report(spec["status_fd"], error=f"launcher: {e}")
        os._exit(infra)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
