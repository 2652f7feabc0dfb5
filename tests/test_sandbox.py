"""The code sandbox contains what a completion's program may try: each case has its expected
verdict and must leave no trace outside (files, processes, connections, signals).

Every case runs in each mode that can start here: ``bwrap`` when bubblewrap works, ``unshare``
when the kernel gives user namespaces, ``rlimit`` when the tests run as root (the program then
runs as an unused uid). The containment probes (other processes' command lines, run directories
and host files, loopback listeners, interfaces, ``/dev/shm`` and ``/tmp``, nested namespaces) run
in the isolating modes, ``bwrap`` and ``unshare``: ``rlimit`` does not isolate by design.
"""

import ast
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from swarmrl.envs.sandbox import FIRST_UID, Limits, Sandbox
from swarmrl.envs.sandbox.modes import tmpfs_bytes
from swarmrl.errors import SandboxError

LIMITS = Limits(cpu_s=1, wall_s=3.0, memory_mb=256, processes=8, output_bytes=4096, file_mb=2)
ROOT = os.geteuid() == 0


def _sandbox(mode):
    try:
        return Sandbox(LIMITS, mode)
    except SandboxError as exc:
        pytest.skip(f"{mode} sandbox unavailable here: {exc}")


@pytest.fixture(scope="module", params=["bwrap", "unshare", "rlimit"])
def sandbox(request):
    if request.param == "rlimit" and not ROOT:
        pytest.skip("rlimit mode isolates processes and files only when run as root")
    return _sandbox(request.param)


@pytest.fixture(scope="module", params=["bwrap", "unshare"])
def isolated(request):
    """A sandbox in each mode that claims isolation."""
    return _sandbox(request.param)


@pytest.fixture
def shared_dir():
    """A directory anyone may read (as a run directory under the default umask is), so that
    only the sandbox keeps the program out of it."""
    path = tempfile.mkdtemp(prefix="swarmrl-run-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def _sandbox_processes(sandbox):
    """Live processes (zombies run nothing) of the uids ``sandbox`` ran as; only when root."""
    assert sandbox.uids and min(sandbox.uids) >= FIRST_UID
    out = subprocess.run(["ps", "-eo", "stat=,uid="], capture_output=True, text=True, check=True)
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    return sum(int(uid) in sandbox.uids and not stat.startswith("Z") for stat, uid in rows)


def test_a_correct_program_runs(sandbox):
    result = sandbox.run("print(int(input()) * 2)", "21\n")
    assert (result.verdict, result.stdout, result.exit_code) == ("ok", "42\n", 0)
    assert sandbox.run("raise SystemExit(3)").exit_code == 3
    assert sandbox.run("1/0").verdict == "error"


def test_infinite_loop_times_out(sandbox):
    start = time.monotonic()
    result = sandbox.run("while True:\n    pass")
    assert result.verdict == "timeout"
    assert time.monotonic() - start < LIMITS.wall_s + 20  # slack for a loaded machine
    assert sandbox.run("import time\ntime.sleep(60)").verdict == "timeout"  # wall, not CPU


def test_fork_bomb_is_capped_and_leaves_nothing_behind(sandbox):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = sandbox.run(bomb)
    assert result.verdict in ("timeout", "killed")
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    if ROOT:
        assert _sandbox_processes(sandbox) == 0
    escaper = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    assert sandbox.run(escaper).stdout == "parent done\n"
    if ROOT:
        assert _sandbox_processes(sandbox) == 0  # the child that left the session died too


def test_memory_hog_is_stopped(sandbox):
    result = sandbox.run("block = bytearray(2**31)\nprint('allocated')")
    assert result.verdict == "memory" and "allocated" not in result.stdout


def test_huge_output_is_cut(sandbox):
    result = sandbox.run("while True:\n    print('x' * 1000)")
    assert result.verdict == "output"
    assert len(result.stdout) <= LIMITS.output_bytes


def test_writing_outside_its_directory_fails(sandbox, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    fresh = tmp_path / "fresh.txt"
    program = (
        f"open({str(victim)!r}, 'w').write('owned')\nopen({str(fresh)!r}, 'w').write('owned')\n"
    )
    result = sandbox.run(program)
    assert result.verdict == "error"
    assert victim.read_text() == "original" and not fresh.exists()
    inside = sandbox.run(
        "open('scratch.txt', 'w').write('mine')\nprint(open('scratch.txt').read())"
    )
    assert inside.stdout == "mine\n"  # its own directory is writable


def test_host_environment_and_files_are_not_readable(sandbox, tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMRL_TEST_SECRET", "hunter2")
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    env = sandbox.run("import os\nprint(dict(os.environ))")
    assert env.verdict == "ok" and "hunter2" not in env.stdout and "SWARMRL" not in env.stdout
    read = sandbox.run(f"print(open({str(secret)!r}).read())")
    assert read.verdict == "error" and "hunter2" not in read.stdout


def test_loopback_listeners_on_the_host_are_unreachable_over_tcp_and_udp(isolated):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    tcp_port, udp_port = server.getsockname()[1], udp.getsockname()[1]
    accepted = []
    done = threading.Event()

    def accept():
        while not done.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    program = (
        "import socket\n"
        "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"for _ in range(20):\n    u.sendto(b'hi', ('127.0.0.1', {udp_port}))\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {tcp_port}), timeout=2).sendall(b'hi')\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print('refused', exc.errno)\n"
    )
    try:
        result = isolated.run(program)
        time.sleep(0.2)
    finally:
        done.set()
        thread.join()
        server.close()
    try:
        datagram = udp.recv(16)
    except BlockingIOError:
        datagram = None
    udp.close()
    assert result.verdict == "ok" and result.stdout.startswith("refused"), result
    assert accepted == [] and datagram is None


def test_it_has_a_private_loopback_and_sees_no_host_interface(isolated):
    program = (
        "import socket\n"
        "print([name for _, name in socket.if_nameindex()])\n"
        "server = socket.create_server(('127.0.0.1', 0))\n"
        "socket.create_connection(server.getsockname()).sendall(b'own')\n"
        "print(server.accept()[0].recv(3).decode())\n"
    )
    result = isolated.run(program)
    assert result.stdout == "['lo']\nown\n", result


def test_other_processes_and_their_command_lines_are_invisible(isolated):
    token = uuid.uuid4().hex
    secret = f"postgresql+psycopg://swarmrl:{token}@127.0.0.1/pool"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--db", secret])
    program = (
        "import os\n"
        "for pid in sorted(p for p in os.listdir('/proc') if p.isdigit()):\n"
        "    try:\n"
        "        print(pid, open(f'/proc/{pid}/cmdline', 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print(pid, exc)\n"
    )
    try:
        time.sleep(0.1)
        result = isolated.run(program)
    finally:
        host.kill()
        host.wait()
    assert result.verdict == "ok" and token not in result.stdout
    assert str(host.pid) not in result.stdout.split()
    assert len(result.stdout.splitlines()) <= 3  # its init, its launcher or bwrap, itself


def test_run_directories_pool_db_and_etc_are_not_visible(isolated, shared_dir):
    token = uuid.uuid4().hex
    database = os.path.join(shared_dir, "pool.db")
    with open(database, "w") as f:
        f.write(token)
    os.chmod(database, 0o644)
    program = (
        f"for path in ({database!r}, '/etc/passwd', '/etc/hostname', '/root/.bashrc'):\n"
        "    try:\n"
        "        print(path, open(path).read())\n"
        "    except OSError as exc:\n"
        "        print(path, type(exc).__name__)\n"
        "import os\n"
        f"print(os.path.exists({shared_dir!r}), os.path.exists('/etc'), os.path.exists('/home'))\n"
    )
    result = isolated.run(program)
    assert result.verdict == "ok" and token not in result.stdout and "root:" not in result.stdout
    assert result.stdout.count("FileNotFoundError") == 4
    assert result.stdout.endswith("False False False\n")


def test_dev_shm_tmp_and_its_directory_are_private_and_capped(isolated):
    token = uuid.uuid4().hex
    cap = tmpfs_bytes(LIMITS.file_mb)
    program = (
        "import errno\n"
        "for where in ('/dev/shm', '/tmp', '.'):\n"
        "    written, failure = 0, None\n"
        "    try:\n"
        f"        for i in range({4 * cap // 2**20}):\n"
        f"            with open(f'{{where}}/{token}-{{i}}', 'wb') as f:\n"
        "                f.write(b'x' * 2**20)\n"
        "            written += 2**20\n"
        "    except OSError as exc:\n"
        "        failure = errno.errorcode[exc.errno]\n"
        "    print(where, written, failure)\n"
    )
    result = isolated.run(program)
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [row[0] for row in rows] == ["/dev/shm", "/tmp", "."], result
    for where, written, failure in rows:
        assert int(written) <= cap and failure in ("ENOSPC", "EFBIG"), (where, written, failure)
    leftovers = glob.glob(f"/dev/shm/{token}*") + glob.glob(f"/tmp/{token}*")
    assert leftovers == []


WRITABLE_PROBE = """
import os
writable = []
for top, dirs, _ in os.walk('/'):
    if top.startswith('/proc') or top.count('/') > 2:
        dirs.clear()
        continue
    try:
        open(os.path.join(top, '.probe'), 'w').close()
    except OSError:
        continue
    stat = os.statvfs(top)
    writable.append((top, stat.f_blocks * stat.f_frsize))
print(writable)
"""


def test_its_only_writable_places_are_three_capped_tmpfs(isolated):
    """Every directory two levels down from ``/`` (less ``/proc``) where the program can
    create a file is ``/sandbox``, ``/tmp`` or ``/dev/shm``, each no larger than its cap."""
    result = isolated.run(WRITABLE_PROBE)
    writable = dict(ast.literal_eval(result.stdout))  # the (path, bytes) pairs it printed
    assert sorted(writable) == ["/dev/shm", "/sandbox", "/tmp"], result
    assert all(size <= tmpfs_bytes(LIMITS.file_mb) for size in writable.values()), writable


def test_it_can_make_no_namespace_or_mount_of_its_own(isolated):
    program = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), libc.unshare(0x00020000))\n"  # user, mount
        "print(libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, b'size=1g'))\n"
    )
    result = isolated.run(program)
    assert result.stdout == "-1 -1\n-1\n", result


def test_killing_its_parent_or_a_host_process_fails(sandbox):
    host = subprocess.Popen(["sleep", "30"])
    try:
        program = (
            "import os, signal\n"
            f"for pid in (os.getppid(), {host.pid}, {os.getpid()}):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError as exc:\n"
            "        print(type(exc).__name__)\n"
        )
        result = sandbox.run(program)
        assert result.verdict in ("ok", "error")
        time.sleep(0.2)
        assert host.poll() is None  # the host process lives (and so does this one)
        assert sandbox.run("print('still works')").stdout == "still works\n"
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()


def test_a_sandbox_that_cannot_start_is_a_one_line_error(tmp_path, monkeypatch):
    with pytest.raises(SandboxError) as info:
        Sandbox(LIMITS, "rlimit", python=str(tmp_path / "no-python"))
    assert "no-python" in str(info.value) and "\n" not in str(info.value)
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on the PATH
    assert shutil.which("bwrap") is None
    with pytest.raises(SandboxError, match="bwrap is not installed") as info:
        Sandbox(LIMITS, "bwrap")
    assert "\n" not in str(info.value)
    if _sandbox("unshare"):
        assert Sandbox(LIMITS, "auto").mode == "unshare"  # isolated without bubblewrap


def test_the_unisolated_mode_runs_only_when_named_and_warns(caplog):
    with caplog.at_level("WARNING", logger="swarmrl.envs.sandbox"):
        sandbox = Sandbox(LIMITS, "rlimit")
    assert sandbox.mode == "rlimit" and sandbox.run("print('ran')").stdout == "ran\n"
    assert any("resource limits only" in r.getMessage() for r in caplog.records)
    with pytest.raises(SandboxError, match="is not one of auto, bwrap, unshare, rlimit"):
        Sandbox(LIMITS, "none")


def test_auto_uses_the_bwrap_on_the_path_wherever_it_is():
    if not os.path.exists("/usr/bin/bwrap"):
        pytest.skip("needs bubblewrap in /usr/bin (apt-get install bubblewrap)")
    bindir = tempfile.mkdtemp(prefix="swarmrl-bin-")
    try:
        os.chmod(bindir, 0o755)
        wrapper = os.path.join(bindir, "bwrap")
        with open(wrapper, "w") as f:
            f.write('#!/bin/sh\nexec /usr/bin/bwrap --setenv FROM_PATH yes "$@"\n')
        os.chmod(wrapper, 0o755)
        path = os.environ["PATH"]
        os.environ["PATH"] = bindir  # the only bwrap: not in /usr/bin or /bin
        try:
            sandbox = Sandbox(LIMITS, "auto")
            result = sandbox.run("import os\nprint(os.environ.get('FROM_PATH'))")
        finally:
            os.environ["PATH"] = path
    finally:
        shutil.rmtree(bindir)
    assert sandbox.mode == "bwrap" and result.stdout == "yes\n"


REFUSAL = """
import logging
from swarmrl.envs.sandbox import Limits, Sandbox
from swarmrl.errors import SandboxError
logging.basicConfig()
try:
    Sandbox(Limits(wall_s=10), "auto")
except SandboxError as exc:
    print("refused:", exc)
box = Sandbox(Limits(wall_s=10), "rlimit")
print("rlimit:", box.run("print(6 * 7)").stdout.strip())
"""


def test_where_no_isolating_mode_starts_auto_refuses_in_one_line():
    """Under a user namespace that may create none (as where a distribution turns them off) and
    without bwrap, ``auto`` refuses, naming both causes and the fixes; ``rlimit`` runs only when
    named, with a warning."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) from util-linux")
    script = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"'  # no nested userns
    env = {**os.environ, "PATH": "/nonexistent"}  # and no bwrap
    argv = [unshare, "--user", "--map-root-user", "/bin/sh", "-c", script, sys.executable, REFUSAL]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"cannot make a user namespace here: {done.stderr.strip()}")
    lines = done.stdout.splitlines()
    assert len(lines) == 2, (done.stdout, done.stderr)
    refusal, unisolated = lines
    assert refusal.startswith("refused: no isolating sandbox can start here (bwrap: bwrap is not")
    assert "unshare: sandbox setup: create namespaces (unshare): No space left" in refusal
    assert "apt-get install bubblewrap" in refusal and "user namespaces" in refusal
    assert unisolated == "rlimit: 42"
    assert "env.sandbox.mode = 'rlimit'" in done.stderr and "only" in done.stderr


UNPRIVILEGED_PROBE = """
import ctypes, errno, os, socket
print(sorted(p for p in os.listdir('/proc') if p.isdigit()), socket.if_nameindex())
print(os.getuid(), os.path.exists('/etc/passwd'), ctypes.CDLL(None).unshare(0x10000000))
written = 0
try:
    for i in range(64):
        with open(f'/dev/shm/{i}', 'wb') as f:
            f.write(b'x' * 2**20)
        written += 1
except OSError as exc:
    print(written, errno.errorcode[exc.errno])
"""


def test_unshare_isolates_an_unprivileged_caller_too(shared_dir):
    """The ``unshare`` mode needs no privilege: run as ``nobody``, its launcher makes the same
    namespaces, filesystem and caps."""
    setpriv = shutil.which("setpriv")
    if not ROOT or setpriv is None or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root, setpriv(1) and /usr/bin/python3 to run as nobody")
    from swarmrl.envs.sandbox import RUNNER
    from swarmrl.envs.sandbox.modes import ISOLATE

    task, root = os.path.join(shared_dir, "task"), os.path.join(shared_dir, "root")
    for path in (task, root):
        os.mkdir(path)
        os.chmod(path, 0o755)
    files = {f"{task}/runner.py": RUNNER, f"{task}/main.py": UNPRIVILEGED_PROBE}
    files[f"{shared_dir}/isolate.py"] = ISOLATE.read_text()
    for path, text in files.items():
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o644)
    nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    launcher = ["/usr/bin/python3", "-I", f"{shared_dir}/isolate.py", root, task, "", str(8 << 20)]
    done = subprocess.run([*nobody, *launcher], capture_output=True, text=True, timeout=60)
    if "sandbox setup: create namespaces" in done.stderr:
        pytest.skip(f"no user namespaces for unprivileged users here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['1', '2'] [(1, 'lo')]", "1000 False -1", "8 ENOSPC"]


def test_a_worker_builds_code_prompts_without_a_sandbox_and_cannot_score_there():
    """Workers only draw tasks and build prompts: a machine where no sandbox can start still
    generates code tasks, while the trusted side (which scores) refuses to start there."""
    from swarmrl.config.env import EnvConfig
    from swarmrl.envs import build_env

    config = EnvConfig.model_validate(
        {"name": "code_tiny", "sandbox": {"mode": "bwrap", "python": "/nonexistent/python3"}}
    )
    with pytest.raises(SandboxError):
        build_env(config)  # the scoring side: refused at start, in one line
    env = build_env(config, scores=False)
    task = env.task("train", 0)
    assert "y=" in task.prompt
    with pytest.raises(SandboxError, match="only builds prompts"):
        env.score(task, task.answer)
