"""Runs INSIDE the sandbox subprocess (``python -I _launcher.py WORKDIR LIMITS_JSON REPORT_FD``).

A fresh, single-threaded interpreter sets up isolation for itself before any untrusted code runs
(no ``preexec_fn``: the rollout worker that spawns it has threads). Each measure is attempted and
what took effect is written as JSON to ``REPORT_FD``, so the parent can say precisely what was
enforced on this machine:

- ``netns``: a new network namespace (no interfaces up, not even loopback): no network at all.
- ``pidns``: the program runs as PID 1 of a new PID namespace; killing it (or its parent, via
  ``PR_SET_PDEATHSIG``) kills every process it started, even ones that called ``setsid``.
- ``fs_readonly``: a private mount namespace in which every mount is remounted read-only, except
  a bind mount of the private working directory; ``TMPDIR`` points there.
- ``caps_dropped``: all capabilities dropped (bounding set, effective/permitted/inheritable,
  ambient), ``SECBIT_NOROOT`` locked and ``no_new_privs``: uid 0 cannot remount or regain caps.
- rlimits (always): CPU seconds, address space, file size, open files, no core dumps, and
  ``RLIMIT_NPROC`` = processes this uid has now + ``max_processes`` (a fork bomb fails with EAGAIN).
- ``processes``: what bounds the number of processes and threads: ``"rlimit"`` (not root: the
  ``RLIMIT_NPROC`` above), ``"cgroup"`` (root: a pids cgroup of its own, ``pids_cgroup``, which
  the parent removes after the run) or ``false``. The kernel never applies ``RLIMIT_NPROC`` to
  uid 0 of the first user namespace, whatever its capabilities: as root with no pids cgroup to
  make (a read-only cgroupfs, as in most containers), a fork bomb runs until the wall clock.

Kept standard-library only and importable without the package (it runs with ``-I``).
"""

import ctypes
import json
import os
import platform
import resource
import runpy
import signal
import sys
import traceback

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 24, 28
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SECBITS_LOCKED_NOROOT = 0x2F  # NOROOT, NO_SETUID_FIXUP and KEEP_CAPS, each locked
_CAPSET_SYSCALL = {"x86_64": 126, "aarch64": 91}

libc = ctypes.CDLL(None, use_errno=True)


def _ok(result: int) -> bool:
    return result == 0


def _unshare(report: dict) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    if os.geteuid() != 0:  # an unprivileged user gets the same through a user namespace
        uid, gid = os.geteuid(), os.getegid()
        if not _ok(libc.unshare(flags | CLONE_NEWUSER)):
            return
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
    elif not _ok(libc.unshare(flags)):
        return
    report["netns"] = report["pidns"] = True
    report["mountns"] = True


def _mounts() -> list[tuple[str, str, list[str], str, list[str]]]:
    """``/proc/self/mountinfo``, a tuple per mount: the root of the mounted tree, the mount
    point, the mount's options, the filesystem type and the superblock's options."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            tail = fields[fields.index("-") + 1:]   # after the optional fields
            mounts.append((fields[3], fields[4].encode().decode("unicode_escape"),
                           fields[5].split(","), tail[0], tail[-1].split(",")))
    return mounts


def _mountpoints() -> list[tuple[str, int]]:
    points = []
    for _, path, options, _, _ in _mounts():
        flags = 0
        for opt in options:
            flags |= _MOUNT_FLAGS.get(opt, 0)
        points.append((path, flags))
    return points


def _readonly_except(workdir: str, report: dict) -> int:
    """Remount everything read-only but a bind of ``workdir``; returns a fd to that bind."""
    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    if not _ok(libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND, None)):
        return os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)  # after the bind: the writable mount
    failed = []
    for path, flags in _mountpoints():
        if path == workdir:
            continue
        if not _ok(libc.mount(b"none", path.encode(), None,
                              MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None)):
            failed.append(path)
    report["fs_readonly"] = "/" not in failed
    report["fs_readonly_failed"] = failed
    return fd


def _drop_caps(report: dict) -> None:
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    secure = _ok(libc.prctl(PR_SET_SECUREBITS, SECBITS_LOCKED_NOROOT, 0, 0, 0))
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (x2 words): all zero
    number = _CAPSET_SYSCALL.get(platform.machine())
    capset = number is not None and _ok(libc.syscall(number, header, data))
    nnp = _ok(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    report["caps_dropped"] = bool(capset and secure and nnp)


def _pids_cgroup(limits: dict, report: dict) -> None:
    """As root, move this process into a new pids cgroup whose ``pids.max`` is
    ``max_processes`` plus this launcher, so that everything the program starts is bounded
    (``RLIMIT_NPROC`` binds nothing on uid 0). Tried in each pids hierarchy this process sits
    in (cgroup v1's ``pids``, or v2's where the pids controller is enabled for children of its
    cgroup); ``report["processes"]`` stays false where none takes a new cgroup."""
    if os.geteuid() != 0:
        report["processes"] = "rlimit"
        return
    for parent in _pids_hierarchies():
        path = os.path.join(parent, f"asyncrl-sandbox-{os.getpid()}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(int(limits["max_processes"]) + 1))
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError:  # no pids controller in this cgroup, or it refused us
            try:
                os.rmdir(path)
            except OSError:
                pass
            continue
        report["processes"], report["pids_cgroup"] = "cgroup", path
        return


def _pids_hierarchies() -> list[str]:
    """The directories of this process's own cgroup in each mounted hierarchy that may hold
    a pids controller: cgroup v1's ``pids`` and the v2 unified one."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            own["cgroup2" if controllers == "" else controllers] = path
    v1_pids = next((c for c in own if "pids" in c.split(",")), None)
    found = []
    for root, mountpoint, _, fstype, options in _mounts():
        if fstype == "cgroup2":
            path = own.get("cgroup2")
        elif fstype == "cgroup" and "pids" in options and v1_pids is not None:
            path = own[v1_pids]
        else:
            continue
        # the mount shows the hierarchy from its root down: our cgroup relative to it
        root = root.rstrip("/")
        if path is not None and (path + "/").startswith(root + "/"):
            found.append(mountpoint + path[len(root):])
    return found


def _count_processes(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def _rlimits(limits: dict, report: dict) -> None:
    cpu = int(limits["cpu_s"])
    memory = int(limits["memory_mb"]) << 20
    nproc = _count_processes(os.getuid()) + int(limits["max_processes"])
    for name, value in (("RLIMIT_CPU", (cpu, cpu + 1)), ("RLIMIT_AS", (memory, memory)),
                        ("RLIMIT_FSIZE", ((int(limits["file_mb"]) << 20,) * 2)),
                        ("RLIMIT_NOFILE", (64, 64)), ("RLIMIT_CORE", (0, 0)),
                        ("RLIMIT_NPROC", (nproc, nproc))):
        resource.setrlimit(getattr(resource, name), value)
    report["rlimits"] = {"cpu_s": cpu, "memory_mb": limits["memory_mb"],
                         "file_mb": limits["file_mb"], "nproc": nproc}


def _guard_sockets() -> None:
    """Fallback when no network namespace could be made: refuse sockets at the Python level.
    Code using ctypes or a subprocess can get around this; the report says ``netns: false``."""
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    socket.socket.connect = socket.socket.connect_ex = refuse  # type: ignore[method-assign]
    socket.create_connection = socket.getaddrinfo = refuse  # type: ignore[assignment]


def _run_program(workdir_fd: int, limits: dict, report: dict, report_fd: int) -> None:
    """In the child (PID 1 of the new namespace): last restrictions, then the program."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.fchdir(workdir_fd)
    os.close(workdir_fd)
    _drop_caps(report)
    _rlimits(limits, report)
    os.write(report_fd, json.dumps(report).encode())
    os.close(report_fd)
    if not report["netns"]:
        _guard_sockets()
    sys.path.insert(0, os.getcwd())
    try:
        runpy.run_path("main.py", run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        sys.stdout.flush()
        os._exit(code if isinstance(code, int) else (0 if code is None else 1))
    except BaseException:  # the program's own failure: report it like python would
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    workdir, limits, report_fd = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    report = {"netns": False, "pidns": False, "mountns": False, "fs_readonly": False,
              "caps_dropped": False, "processes": False}
    os.environ["TMPDIR"] = workdir
    _pids_cgroup(limits, report)  # before the mounts turn read-only; the program inherits it
    _unshare(report)
    fd = _readonly_except(workdir, report) if report["mountns"] \
        else os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    pid = os.fork()
    if pid == 0:
        _run_program(fd, limits, report, report_fd)
    os.close(report_fd)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
