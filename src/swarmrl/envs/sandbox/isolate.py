"""The ``unshare`` sandbox's first process: isolates itself with kernel namespaces, then runs
the program. Executed as ``python -I <a copy of this file> ROOT TASK PREFIX TMPFS_BYTES`` by the
sandbox's interpreter (any Python 3.9+), so it imports only the standard library.

Three processes, as in bubblewrap:

- the launcher (this process, in the caller's PID namespace) drops into new user, mount, PID,
  network, IPC, UTS and cgroup namespaces (``unshare(2)``), maps its own uid and gid to 1000
  inside, forks the init, drops its capabilities and passes on how the program ended (its
  exit status, or it dies by the same signal);
- the init (PID 1 of the new PID namespace) builds the filesystem on a fresh tmpfs at ROOT and
  moves into it (``pivot_root(2)``), brings the private loopback up, forbids further user
  namespaces, drops every capability, makes itself undumpable (the program cannot ptrace it),
  forks the program and waits for it. When the init exits, the kernel kills whatever the
  program left running in the namespace; when the launcher dies, the init gets ``SIGKILL``
  (``PR_SET_PDEATHSIG``);
- the program (PID 2) runs ``/task/runner.py`` in this interpreter (no second interpreter
  start-up), with no capabilities and ``no_new_privs``, as uid 1000 of a namespace that maps
  nothing else.

The filesystem it sees: ``/usr`` (and the ``/bin``, ``/lib``… links or directories) and the
interpreter's installation PREFIX read-only; TASK read-only at ``/task``; tmpfs of TMPFS_BYTES
each at ``/sandbox`` (the working directory), ``/tmp`` and ``/dev/shm``; a read-only ``/dev``
with ``null``, ``zero``, ``full``, ``random``, ``urandom``; a ``/proc`` of the new PID namespace
whose ``/proc/sys`` is read-only. Nothing else of the host: no ``/etc``, ``/home``, ``/root``,
run directories or the host's ``/tmp``. Every writable filesystem is a tmpfs with a size cap,
and the program can mount no other (it has no capabilities and may create no user namespace).

A step that fails prints ``sandbox setup: <step>: <reason>`` on stderr and exits with status
91. Knows nothing of limits (the caller sets rlimits before ``exec``) or of verdicts.
"""

import _signal  # the C modules: signal and socket import enum, which costs more than the rest
import _socket
import ctypes
import errno
import fcntl
import os
import struct
import sys

EXIT_SETUP = 91
INNER_ID = 1000  # the uid and gid the program has inside its user namespace
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
ST_RELATIME = 4096  # statvfs's flag; the others used here have their MS_ values
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 38, 47
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)


def fail(step, err=None):
    reason = os.strerror(err if err is not None else ctypes.get_errno())
    os.write(2, f"sandbox setup: {step}: {reason}\n".encode())
    os._exit(EXIT_SETUP)


def call(step, result):
    if result != 0:
        fail(step)


def write(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        fail(f"write {path}", exc.errno)


def mount(source, target, fstype, flags, data=None):
    def enc(text):
        return None if text is None else text.encode()

    result = libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    call(f"mount {target}", result)


def locked_flags(path):
    """The flags of the mount holding ``path`` that a user namespace may not clear (read-only,
    nosuid, nodev, noexec, the atime mode): a remount must repeat them."""
    have = os.statvfs(path).f_flag
    atime = MS_NOATIME if have & MS_NOATIME else MS_RELATIME if have & ST_RELATIME else 0
    kept = have & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NODIRATIME)
    return kept | (atime or MS_STRICTATIME)


def bind(source, target, writable=False):
    mount(source, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | locked_flags(source)
    mount(None, target, None, flags | (0 if writable else MS_RDONLY | MS_NODEV))


def tmpfs(target, size, mode):
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}")


def build_root(root, task, prefix, size):
    """The filesystem under ``root`` (see the module docstring); ``/proc`` comes later."""
    call(
        "make mounts private",
        libc.mount(None, b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None),
    )
    tmpfs(root, 1 << 20, "0755")
    for top in ("usr", "task", "sandbox", "tmp", "dev", "proc"):
        os.mkdir(f"{root}/{top}")
    bind("/usr", f"{root}/usr")
    for top in ("bin", "lib", "lib32", "lib64", "sbin"):
        host = f"/{top}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}{host}")
        elif os.path.isdir(host):
            os.mkdir(f"{root}{host}")
            bind(host, f"{root}{host}")
    if prefix and not os.path.exists(f"{root}{prefix}"):
        os.makedirs(f"{root}{prefix}")
        bind(prefix, f"{root}{prefix}")
    bind(task, f"{root}/task")
    tmpfs(f"{root}/sandbox", size, "0755")
    tmpfs(f"{root}/tmp", size, "1777")
    tmpfs(f"{root}/dev", 1 << 16, "0755")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        bind(f"/dev/{name}", f"{root}/dev/{name}", writable=True)
    os.mkdir(f"{root}/dev/shm")
    tmpfs(f"{root}/dev/shm", size, "1777")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, f"{root}/dev/{name}")
    os.symlink("/proc/self/fd/1", f"{root}/dev/stdout")
    os.symlink("/proc/self/fd/2", f"{root}/dev/stderr")
    mount(None, f"{root}/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def lock_down(root):
    """``/proc`` of this PID namespace, no further user namespaces, a read-only ``/proc/sys``
    and root, then ``pivot_root`` into ``root``."""
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    write(f"{root}/proc/sys/user/max_user_namespaces", "0")
    bind(f"{root}/proc/sys", f"{root}/proc/sys")
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        fail("pivot_root", errno.ENOSYS)
    os.chdir(root)
    call("pivot_root", libc.syscall(number, b".", b"."))
    call("detach the host's root", libc.umount2(b".", MNT_DETACH))
    os.chdir("/sandbox")


def loopback_up():
    sock = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    request = struct.pack("16sH22x", b"lo", 0)
    flags = struct.unpack("16sH22x", fcntl.ioctl(sock.fileno(), 0x8913, request))[1]  # SIOCGIFFLAGS
    fcntl.ioctl(sock.fileno(), 0x8914, struct.pack("16sH22x", b"lo", flags | 1))  # SIOCSIFFLAGS: up
    sock.close()


def drop_capabilities():
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL:  # past the last capability
                break
            fail("drop the bounding set")
    libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL (absent before 4.3)
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    call("drop capabilities", libc.capset(header, bytes(24)))
    call("set no_new_privs", libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))


def init(root, task, prefix, size, status_fd):
    """PID 1: build, lock down, run the program as PID 2, report its wait status."""
    libc.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
    build_root(root, task, prefix, size)
    lock_down(root)
    try:
        loopback_up()
    except OSError as exc:
        fail("bring the loopback up", exc.errno)
    name = b"sandbox"
    call("set the hostname", libc.sethostname(name, len(name)))
    drop_capabilities()
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the program may not ptrace its init
    child = os.fork()
    if child == 0:
        os.close(status_fd)
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        return  # the program: the caller runs it
    while True:
        pid, status = os.wait()
        if pid == child:
            break
    os.write(status_fd, str(status).encode())
    os._exit(0)  # the kernel now kills whatever else runs in this PID namespace


def launch():
    """The launcher: namespaces, uid/gid maps, the init; returns only in the program."""
    root, task, prefix, size = sys.argv[1:5]
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
    call("create namespaces (unshare)", libc.unshare(flags | CLONE_NEWUTS | CLONE_NEWCGROUP))
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{INNER_ID} {uid} 1")
    write("/proc/self/gid_map", f"{INNER_ID} {gid} 1")
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_fd)
        init(root, task, prefix, int(size), write_fd)
        return
    os.close(write_fd)
    drop_capabilities()  # nothing left for the launcher to set up
    _, init_status = os.waitpid(child, 0)
    report = os.read(read_fd, 32)
    status = int(report) if report else init_status
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (_signal.SIGKILL, _signal.SIGSTOP):
            _signal.signal(sig, _signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else EXIT_SETUP)


def exit_status(code):
    """The exit status of ``raise SystemExit(code)``, as the interpreter makes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # a program may have closed or replaced stderr
        pass
    return 1


def finish(status):
    """End the program as the interpreter would (its other threads, ``atexit``, buffered
    output), but skip the teardown of this copy of the launcher's heap, which costs more
    than a trivial program's run."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            for thread in threading.enumerate():
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as exc:
        status = exit_status(exc.code)
    except BaseException:
        status = status or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # closed or replaced by the program: the interpreter ignores it too
            pass
    os._exit(status)


launch()  # returns only in the program
try:
    with open("/task/runner.py") as runner:
        exec(compile(runner.read(), "/task/runner.py", "exec"), {"__name__": "__runner__"})
except SystemExit as exc:
    finish(exit_status(exc.code))
finish(0)
