"""docs/deploy.md's worked example, run on a test bed: one network namespace per host of the
page, each role started with the page's own command line.

:func:`page_commands` reads every ``host$ swarmrl …`` line of the page (continuation lines
joined). :class:`Deployment` gives each of the page's hosts (``trainer.lan``, ``orch.lan``,
``relay.lan``, ``gpu1.lan``, ``gpu2.lan``) a host of a :class:`swarmrl.testing.hosts.TestBed`
and a folder of its own (its "disk": the page's ``/srv/…`` paths and relative files live
there), and runs the page's commands on them in the page's order with only the page's
placeholders replaced: the printed public keys (``7a3f…``), the addresses (``10.0.0.20`` → the
namespace's), ``/srv/`` → the host's folder, ``my.toml`` → the config given. Files the page
says to copy between hosts (invites, the config) are copied.

Links and machines can be made worse per host: ``links`` caps a host's bandwidth (``tbf``);
``impair`` puts a ``linkproxy`` inside a host in front of every server of the other hosts it
talks to, or of those it names (``{"relay.lan": {"trainer.lan": {...}}}``), on ``127.0.0.1`` at
the server's port (that host's commands then name ``127.0.0.1`` where the page names such a
server), adding delay, jitter, modelled loss and resets to everything it sends and receives
there; ``cpu`` holds a host's roles to a fraction of a core; ``skew`` sets a host's wall clock
that many seconds off for every command run on it (``swarmrl.testing.skewclock``).

Knows the page's layout and the roles' command lines, nothing about what the roles compute.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmrl.identity import load_keypair
from swarmrl.testing.hosts import Host, TestBed

SWARMRL = [sys.executable, "-m", "swarmrl.cli"]
SKEWCLOCK = str(Path(__file__).with_name("skewclock"))  # its sitecustomize sets a clock off
# the page's hosts and the addresses it gives them; hosts without an address get one anyway
PAGE_HOSTS = {
    "trainer.lan": "10.0.0.10",
    "orch.lan": "10.0.0.20",
    "relay.lan": "10.0.0.30",
    "gpu1.lan": None,
    "gpu2.lan": None,
}
# the long-running roles, in the page's order; the others run to completion
ROLES = ("orchestrator", "trainer", "relay", "validator", "worker")
AFTER = ("report", "ledger")  # what the page runs once the run is over
SERVERS = {"orch.lan": 8600, "trainer.lan": 8470, "relay.lan": 8471}  # the page's ports


def fill_placeholder(arg: str, placeholders: dict[str, str]) -> str:
    """``arg`` with a page placeholder (``c41d…``) filled in, alone or before ``=``
    (``--validator-engine c41d…=torch``)."""
    head, sep, tail = arg.partition("=")
    if sep and head in placeholders:
        return placeholders[head] + sep + tail
    return placeholders.get(arg, arg)


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block of the page."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def page_commands(page: Path) -> list[tuple[str, list[str]]]:
    """Every ``host$ swarmrl …`` command of the page: (host, argv after ``swarmrl``)."""
    commands = []
    for _, body in _blocks(page.read_text()):
        joined = re.sub(r"\\\n\s*", "", body)
        for line in joined.splitlines():
            match = re.match(r"^([\w.-]+)\$\s+swarmrl\s+(.*?)\s*(#.*)?$", line)
            if match:
                commands.append((match.group(1), shlex.split(match.group(2))))
    return commands


@dataclass
class Started:
    """A long-running role the deployment started."""

    name: str
    host: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Deployment:
    """The page's hosts on ``bed``, each with its folder under ``root``."""

    bed: TestBed
    root: Path
    config: Path  # stands for the page's my.toml, copied to every host
    links: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # host → the impairment of its way to every other host's server, or → {server host: one}
    impair: dict[str, dict[str, Any]] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    skew: dict[str, float] = field(default_factory=dict)  # host → its clock's error, s
    hosts: dict[str, Host] = field(default_factory=dict)
    placeholders: dict[str, str] = field(default_factory=dict)
    roles: list[Started] = field(default_factory=list)
    cgroups: dict[str, Path] = field(default_factory=dict)  # role name → its cgroup (``cpu``)
    proxied: dict[str, set[str]] = field(default_factory=dict)  # host → servers it reaches by proxy

    def __post_init__(self) -> None:
        for name, page_address in PAGE_HOSTS.items():
            short = name.split(".")[0]
            host = self.bed.add_host(short, **self.links.get(name, {}))
            self.hosts[name] = host
            if page_address is not None:
                self.placeholders[page_address] = host.address
            self.folder(name).mkdir(parents=True)
            shutil.copy(self.config, self.folder(name) / "my.toml")
        for name, how in self.impair.items():
            per_server = (
                how
                if how and all(isinstance(v, dict) for v in how.values())
                else {server: how for server in SERVERS if server != name}
            )
            for server, impairment in per_server.items():
                if server == name or server not in SERVERS:  # its own port is its server's
                    raise ValueError(f"{name} cannot reach {server} by proxy: not another server")
                port = SERVERS[server]
                self.hosts[name].proxy(
                    port,
                    (self.hosts[server].address, port),
                    listen_address="127.0.0.1",
                    seed=list(SERVERS).index(server),
                    **impairment,
                )
                self.proxied.setdefault(name, set()).add(server)

    def folder(self, host: str) -> Path:
        return self.root / host

    def fill(self, host: str, argv: list[str]) -> list[str]:
        """The page's argv with its placeholders replaced for ``host``."""
        out = []
        for arg in argv:
            arg = fill_placeholder(arg, self.placeholders)
            for page_address, address in self.placeholders.items():
                if re.fullmatch(r"[\d.]+", page_address):
                    server = next(h for h, a in PAGE_HOSTS.items() if a == page_address)
                    proxied = server in self.proxied.get(host, ())
                    arg = arg.replace(
                        f"//{page_address}:", f"//{'127.0.0.1' if proxied else address}:"
                    )
            arg = re.sub(
                r"(^|=|sqlite:///)/srv/", lambda m: f"{m.group(1)}{self.folder(host)}/srv/", arg
            )
            out.append(arg)
        return out

    def environment(self, host: str) -> dict[str, str] | None:
        """The environment of a command on ``host``: ours, with its clock set off if it is
        skewed (None: ours unchanged)."""
        if not self.skew.get(host):
            return None
        path = [SKEWCLOCK, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        return os.environ | {
            "PYTHONPATH": os.pathsep.join(path),
            "SWARMRL_CLOCK_SKEW_S": repr(self.skew[host]),
        }

    def run(self, host: str, argv: list[str], timeout: float = 120.0) -> str:
        """One of the page's commands that runs to completion, on its host, in its folder."""
        return self.hosts[host].run(
            SWARMRL + self.fill(host, argv),
            timeout=timeout,
            cwd=self.folder(host),
            env=self.environment(host),
        )

    def start(self, host: str, argv: list[str]) -> Started:
        """One of the page's long-running roles, on its host, logging to its folder."""
        name = f"{argv[0]}@{host.split('.')[0]}"
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(exist_ok=True)
        with open(log, "wb") as out:
            proc = self.hosts[host].popen(
                SWARMRL + self.fill(host, argv),
                cpu_fraction=self.cpu.get(host),
                cwd=self.folder(host),
                env=self.environment(host),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        started = Started(name, host, proc, log)
        if host in self.cpu:
            self.cgroups[name] = self.bed.cgroups()[-1]
        self.roles.append(started)
        return started

    def learn_keys(self) -> None:
        """The page's printed keys (``7a3f…``) → the keys its ``keys new`` lines made."""
        made = {
            ("trainer.lan", "trainer.key"): ("7a3f…", "public_key_hex"),
            ("trainer.lan", "validator.key"): ("c41d…", "public_key_hex"),
            ("orch.lan", "orchestrator.key"): ("0bac…", "public_key_hex"),
            ("gpu1.lan", "worker.key"): ("5e0c…", "node_id"),
            ("gpu2.lan", "worker.key"): ("9d21…", "node_id"),
        }
        for (host, file), (placeholder, attribute) in made.items():
            key = load_keypair(self.folder(host) / file)
            self.placeholders[placeholder] = getattr(key, attribute)

    def throttle(self, role: str, fraction: float) -> None:
        """Hold ``role`` (started on a host of ``cpu``) to ``fraction`` of a core from now on."""
        self.bed.set_cpu(self.cgroups[role], fraction)

    def copy(self, source_host: str, file: str, target_host: str) -> None:
        shutil.copy(self.folder(source_host) / file, self.folder(target_host) / file)

    def follow_page(self, page: Path, timeout_s: float = 120.0) -> dict[str, Started]:
        """Run the page's steps 1-8 in order; the long-running roles by their name@host.

        Copies what the page says travels: the invites to their workers (``--invite FILE``).
        What the page runs after the run (``report``, ``ledger``) is :meth:`after_run`'s.
        """
        commands = page_commands(page)
        for host, argv in commands:
            if argv[:2] == ["keys", "new"]:
                self.run(host, argv, timeout_s)
        self.learn_keys()
        for host, argv in commands:
            if argv[0] in AFTER or argv[:2] == ["keys", "new"]:
                continue
            if argv[0] in ROLES:
                if "--invite" in argv:
                    invite = argv[argv.index("--invite") + 1]
                    owner = next(h for h, a in commands if a[-1:] == [invite])
                    self.copy(owner, invite, host)
                self.start(host, argv)
            else:
                self.run(host, argv, timeout_s)
        return {role.name: role for role in self.roles}

    def after_run(
        self, page: Path, verbs: tuple[str, ...] = AFTER, timeout_s: float = 120.0
    ) -> list[str]:
        """Run the page's commands for after the run (those of ``verbs``), in order; their
        outputs."""
        return [
            self.run(host, argv, timeout_s)
            for host, argv in page_commands(page)
            if argv[0] in verbs
        ]

    def wait(self, role: Started, timeout_s: float) -> int:
        """``role``'s exit status once it exits; raise with every role's log tail if a role
        dies first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = role.proc.poll()
            if code is not None:
                return code
            time.sleep(0.5)
        raise TimeoutError(f"{role.name} still running after {timeout_s:.0f} s\n{self.tails()}")

    def tails(self, lines: int = 15) -> str:
        return "\n".join(f"--- {r.name} ---\n{r.tail(lines)}" for r in self.roles)


@dataclass
class Outcome:
    """What a run of the worked example left: the report (written again by the page's ``swarmrl
    report`` once workers and validators stopped) and metrics, each role's log and exit status,
    and the seconds from the first command to the trainer's exit."""

    report: dict[str, Any]
    metrics: list[dict[str, Any]]
    logs: dict[str, str]
    exits: dict[str, int | None]
    seconds: float
    after: list[str]  # what the page's ``swarmrl report`` printed after the run

    def receipts(self, role: str) -> int:
        """Submissions the orchestrator acknowledged to worker ``role`` (its log's count)."""
        return len(re.findall(r"submitted \d+ samples", self.logs[role]))

    def taken_in(self, role: str) -> int:
        """Submissions the pool holds from worker ``role`` (the report's count)."""
        node = re.search(r"worker-([0-9a-f]{8})", self.logs[role])
        rows = [w for w in self.report["swarm"]["workers"] if node and w["name"] == node.group(1)]
        return int(rows[0]["taken_in"]) if rows else 0

    def seconds_per_step(self) -> float:
        """The RL loop's wall seconds per step (its last row's ``wall_time`` ÷ steps)."""
        return float(self.metrics[-1]["wall_time"]) / len(self.metrics)


def run_example(
    page: Path,
    root: Path,
    config: Path,
    *,
    during: Callable[[Deployment, dict[str, Started]], None] | None = None,
    before_close: Callable[[Deployment], None] | None = None,
    timeout_s: float = 80.0,
    **worse: Any,
) -> Outcome:
    """The page's worked example on a fresh bed (``worse``: ``links``, ``impair``, ``cpu``, ``skew`` of
    :class:`Deployment`), ``during`` called once every role is started (to cut a link, kill a
    relay…); returns when the trainer exits (raising with every role's log tail if it fails or
    outlives ``timeout_s``), after waiting up to 20 s for workers and validators to stop and
    calling ``before_close`` (the servers still up: to read a relay's counters…)."""
    started_at = time.monotonic()
    with TestBed() as bed:
        deployment = Deployment(bed, root, config, **worse)
        roles = deployment.follow_page(page)
        if during is not None:
            during(deployment, roles)
        trainer = roles["trainer@trainer"]
        code = deployment.wait(trainer, timeout_s - (time.monotonic() - started_at))
        seconds = time.monotonic() - started_at
        if code != 0:
            raise RuntimeError(f"the trainer exited {code}\n{deployment.tails()}")
        settle = time.monotonic() + 20
        for role in roles.values():
            if role.name.split("@")[0] in ("worker", "validator"):
                while role.proc.poll() is None and time.monotonic() < settle:
                    time.sleep(0.2)
        exits = {name: role.proc.poll() for name, role in roles.items()}
        if before_close is not None:
            before_close(deployment)
        # the report again, now that the workers have stopped: what a worker submitted after
        # the trainer's end (a unit it held through a cut) is in the pool's final account
        after = deployment.after_run(page, ("report",))
    run_dir = deployment.folder("trainer.lan") / "srv" / "swarm"
    return Outcome(
        report=json.loads((run_dir / "report.json").read_text()),
        metrics=[json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()],
        logs={name: role.log.read_text(errors="replace") for name, role in roles.items()},
        exits=exits,
        seconds=seconds,
        after=after,
    )
