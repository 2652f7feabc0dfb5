"""The code sandbox contains what a completion's program may try: each case has its expected
verdict and must leave no trace outside (files, processes, connections, signals).

Every case runs in each mode that can start here: ``bwrap`` when bubblewrap works, ``rlimit``
when the tests run as root (the program then runs as an unused uid). Cases the rlimit mode does
not isolate by design (network; anything as an ordinary user) run only under bwrap.
"""

import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

from swarmrl.envs.sandbox import FIRST_UID, Limits, Sandbox
from swarmrl.errors import SandboxError

LIMITS = Limits(cpu_s=1, wall_s=3.0, memory_mb=256, processes=8, output_bytes=4096, file_mb=2)
ROOT = os.geteuid() == 0


def _sandbox(mode):
    try:
        return Sandbox(LIMITS, mode)
    except SandboxError as exc:
        pytest.skip(f"{mode} sandbox unavailable here: {exc}")


@pytest.fixture(scope="module", params=["bwrap", "rlimit"])
def sandbox(request):
    if request.param == "rlimit" and not ROOT:
        pytest.skip("rlimit mode isolates processes and files only when run as root")
    return _sandbox(request.param)


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


def test_network_connection_is_refused(tmp_path):
    sandbox = _sandbox("bwrap")  # rlimit mode does not isolate the network (see the docs)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
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
        f"socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n"
        "print('connected')"
    )
    result = sandbox.run(program)
    done.set()
    thread.join()
    server.close()
    assert result.verdict == "error" and "connected" not in result.stdout
    assert accepted == []


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
    assert Sandbox(LIMITS, "auto").mode == "rlimit"  # auto falls back
