"""The supervisor starts, watches and stops real child processes and leaves no orphans."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from swarmrl.errors import WaitTimeout
from swarmrl.rolekit.supervisor import RoleExited, Supervisor, free_port, wait_until


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return True
    return state in {"Z", "X"}


def _wait_gone(pid: int, timeout_s: float = 60.0) -> None:
    wait_until(lambda: _gone(pid), f"pid {pid} to exit", timeout_s, interval_s=0.05)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


SPAWNS_GRANDCHILD = """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("GRANDCHILD-PID", child.pid, flush=True)
    time.sleep(600)
"""


def _said(role, marker: str) -> str | None:
    """The first line of the role's own output starting with ``marker`` (the log header quotes
    the command line, so plain substring search would match too early)."""
    lines = role.log_path.read_text().splitlines()
    return next((x for x in lines if x.startswith(marker)), None)


def _grandchild_pid(role) -> int:
    wait_until(lambda: _said(role, "GRANDCHILD-PID") is not None, "the role's child pid", 60)
    return int(_said(role, "GRANDCHILD-PID").split()[1])


def test_shutdown_stops_role_and_its_children(tmp_path):
    with Supervisor(tmp_path, grace_s=5) as sup:
        role = sup.start("spawner", _py(SPAWNS_GRANDCHILD))
        grandchild = _grandchild_pid(role)
        assert not _gone(grandchild)
    _wait_gone(role.pid)
    _wait_gone(grandchild)
    assert (tmp_path / "logs" / "spawner.log").is_file()


def test_role_ignoring_sigterm_is_killed_after_grace(tmp_path):
    stubborn = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("SIGTERM-IGNORED", flush=True)
        time.sleep(600)
    """
    sup = Supervisor(tmp_path, grace_s=0.5)
    role = sup.start("stubborn", _py(stubborn))
    wait_until(lambda: _said(role, "SIGTERM-IGNORED") is not None, "the role to start", 60)
    start = time.monotonic()
    sup.shutdown()
    assert _gone(role.pid)
    assert role.popen.returncode == -signal.SIGKILL
    assert time.monotonic() - start < 30  # not left running: it would sleep 600 s


def test_check_reports_a_dead_role_with_its_log_tail(tmp_path):
    with Supervisor(tmp_path, grace_s=2) as sup:
        role = sup.start("crasher", _py("import sys; print('boom: no weights'); sys.exit(3)"))
        role.popen.wait(timeout=60)
        with pytest.raises(RoleExited, match="crasher exited with status 3") as info:
            sup.check()
        # the first line says why, in the role's last words; the log's tail follows
        lines = str(info.value).splitlines()
        assert lines[0] == "role crasher exited with status 3: boom: no weights"
        assert lines[1] == f"last lines of {role.log_path}:"


def test_check_allows_expected_clean_exit(tmp_path):
    with Supervisor(tmp_path, grace_s=2) as sup:
        role = sup.start("done", _py("print('ok')"))
        role.popen.wait(timeout=60)
        sup.check(expected_done=["done"])


def test_wait_ready_names_what_it_waits_for(tmp_path):
    with Supervisor(tmp_path, grace_s=2) as sup:
        sup.start("sleeper", _py("import time; time.sleep(600)"))
        port = free_port()
        with pytest.raises(
            WaitTimeout, match=rf"sleeper to be ready \(GET http://127.0.0.1:{port}/"
        ):
            sup.wait_http("sleeper", f"http://127.0.0.1:{port}/health", timeout_s=0.5)


def test_wait_ready_fails_fast_when_role_dies(tmp_path):
    with Supervisor(tmp_path, grace_s=2) as sup:
        sup.start("dies", _py("import sys; print('bad key file'); sys.exit(2)"))
        start = time.monotonic()
        with pytest.raises(RoleExited, match="bad key file"):
            sup.wait_ready("dies", lambda: False, "never", timeout_s=60)
        assert time.monotonic() - start < 30


SUPERVISOR_SCRIPT = """
    import sys, time
    from swarmrl.rolekit.supervisor import Supervisor, terminate_as_interrupt
    run_dir = sys.argv[1]
    with terminate_as_interrupt(), Supervisor(run_dir, grace_s=2) as sup:
        role = sup.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            print("child", role.pid, flush=True)
            time.sleep(600)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise SystemExit(130)
"""


def _start_supervisor_process(tmp_path):
    proc = subprocess.Popen(
        [*_py(SUPERVISOR_SCRIPT), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("child"), line
    return proc, int(line.split()[1])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_supervisor_stops_its_roles(tmp_path, sig):
    proc, child = _start_supervisor_process(tmp_path)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 130
    _wait_gone(child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_killed_supervisor_leaves_no_orphans(tmp_path):
    proc, child = _start_supervisor_process(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    _wait_gone(child)


def test_roles_stopped_on_purpose_are_not_failures(tmp_path):
    with Supervisor(tmp_path, grace_s=2) as sup:
        sup.start("relay", _py("import time; time.sleep(600)"))
        sup.start("other", _py("import time; time.sleep(600)"))
        sup.kill("relay")
        sup.check()  # the killed role does not count as a crash
        sup.start("relay", _py("import sys; sys.exit(4)"))  # a restart is watched again
        sup.roles["relay"].popen.wait(timeout=60)
        with pytest.raises(RoleExited, match="relay exited with status 4"):
            sup.check()


def test_a_crashed_role_is_restarted_a_bounded_number_of_times(tmp_path):
    """A role that dies is started again (logged, with a pause), until max_restarts; a role
    that exits as banned or finished, or was retired, is not."""
    crash = _py("import sys; print('up', flush=True); sys.exit(1)")
    with Supervisor(tmp_path, grace_s=2, max_restarts=2, restart_backoff_s=0.01) as sup:
        sup.start("flaky", crash)
        sup.start("banned", _py("import sys; sys.exit(3)"))
        sup.retire("banned")  # expected to leave; not restarted either way
        sup.start("done", _py("pass"))
        restarted: list[str] = []
        with pytest.raises(RoleExited, match="role flaky exited with status 1"):
            for _ in range(200):
                restarted += sup.tend(expected_done=["done"])
                time.sleep(0.05)
        assert restarted == ["flaky", "flaky"]
        assert sup.roles["flaky"].restarts == 2
        log = (tmp_path / "logs" / "flaky.log").read_text()
        assert log.count("\nup\n") == 3 and "restart 2" in log
        assert len(sup.events) == 2

    with Supervisor(tmp_path / "b", grace_s=2, max_restarts=5, restart_backoff_s=0.01) as sup:
        sup.start("worker", _py("import sys; sys.exit(3)"))
        with pytest.raises(RoleExited, match="status 3"):
            for _ in range(200):
                assert sup.tend() == []
                time.sleep(0.05)


SPAWNS_IN_OWN_SESSION = """
    import subprocess, sys, time
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    print("GRANDCHILD-PID", child.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("how", ["stop-kill", "stop-term", "shutdown"])
def test_what_a_role_started_in_its_own_session_is_stopped_with_it(tmp_path, how):
    # torchrun starts its ranks this way: a signal to the role's group alone would miss them,
    # and a SIGKILLed trainer's ranks would train on beside the one started in its place
    with Supervisor(tmp_path, grace_s=5) as sup:
        role = sup.start("launcher", _py(SPAWNS_IN_OWN_SESSION))
        grandchild = _grandchild_pid(role)
        assert os.getpgid(grandchild) != role.pid
        if how == "stop-kill":
            assert sup.stop("launcher", signal.SIGKILL) == -signal.SIGKILL
        elif how == "stop-term":
            assert sup.stop("launcher") == -signal.SIGTERM
        else:
            sup.shutdown()
        _wait_gone(grandchild, timeout_s=10)


def test_a_stray_whose_pid_was_reused_is_left_alone(tmp_path):
    # a remembered pid is signalled only while it is the same process (same start time)
    with Supervisor(tmp_path, grace_s=5) as sup:
        role = sup.start("launcher", _py(SPAWNS_IN_OWN_SESSION))
        grandchild = _grandchild_pid(role)
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            role.strays[bystander.pid] = "0"  # as if an earlier process had held this pid
            sup.stop("launcher", signal.SIGKILL)
            _wait_gone(grandchild, timeout_s=10)
            assert bystander.poll() is None
        finally:
            bystander.kill()
            bystander.wait()


RANK_THAT_DIES_WITH_TORCHRUN = """
import os, signal, time
from swarmrl.rolekit.supervisor import die_with_parent
die_with_parent(signal.SIGKILL)  # what the trainer does under torchrun
print("RANK-PID", os.getpid(), flush=True)
time.sleep(600)
"""


def test_a_rank_dies_with_its_killed_torchrun(tmp_path):
    # torchrun SIGKILLed from outside any supervisor (the kernel's OOM killer, a user's kill -9):
    # its ranks, each in a session of its own, are told by the kernel and end too
    script = tmp_path / "rank.py"
    script.write_text(RANK_THAT_DIES_WITH_TORCHRUN)
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        torchrun = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=1", str(script)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:

        def rank_said() -> bool:
            return "RANK-PID" in log.read_text()

        wait_until(rank_said, "the rank to start", 120)
        line = next(x for x in log.read_text().splitlines() if "RANK-PID" in x)
        rank = int(line.split("RANK-PID")[1].split()[0])
        time.sleep(1.0)
        assert not _gone(rank)  # the death signal is not fired early by torchrun's threads
        os.kill(torchrun.pid, signal.SIGKILL)
        torchrun.wait()
        _wait_gone(rank, timeout_s=10)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()
