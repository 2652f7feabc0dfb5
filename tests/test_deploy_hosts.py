"""docs/deploy.md's worked example, run as written: five hosts (network namespaces of
``swarmrl.testing.hosts``), each role started with the page's command line on the page's host,
the workers behind 20 Mbit/s links; the run reaches its end with a report and a verified ledger,
and the page's after-the-run commands work. Needs root (skips elsewhere, saying why)."""

import json
import re
from pathlib import Path

import pytest
import tomli_w

from swarmrl.config import EMBEDDED_DEFAULT
from swarmrl.config.load import read_toml
from swarmrl.testing.deploy import Deployment, page_commands
from swarmrl.testing.hosts import TestBed, unavailable_reason

PAGE = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
NO_BED = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(NO_BED is not None, reason=NO_BED or ""),
    pytest.mark.slow,
    pytest.mark.xdist_group("netns"),  # the test beds share one subnet: one at a time
]

# the page's my.toml: configs/arith.toml made small enough to run in seconds
SMALL = {
    "env": {"digits": 1},
    "model": {"tiny": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64}},
    "sft": {"steps": 4, "batch_size": 16},
    # 4 steps: the relay, started before the trainer's origin, notices it within its 2 s
    # backoff and follows the versions while the run lasts
    "rl": {"steps": 4, "prompts_per_step": 2, "group_size": 2},
    "eval": {"n": 4, "control": False},
}
LINKS = {
    "trainer.lan": {"up_mbit": 40},
    "gpu1.lan": {"up_mbit": 20, "down_mbit": 20},
    "gpu2.lan": {"up_mbit": 20, "down_mbit": 20},
}


def small_config(tmp_path: Path, **sections: dict) -> Path:
    """The page's my.toml: SMALL, then ``sections`` over it."""
    data = read_toml(EMBEDDED_DEFAULT)
    for section, values in [*SMALL.items(), *sections.items()]:
        data.setdefault(section, {}).update(values)
    data["run"]["cache_dir"] = str(tmp_path / "cache")
    path = tmp_path / "my.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def test_the_pages_worked_example_runs_as_written_on_five_hosts(tmp_path):
    hosts_on_page = {host for host, _ in page_commands(PAGE)}
    assert hosts_on_page == {"trainer.lan", "orch.lan", "relay.lan", "gpu1.lan", "gpu2.lan"}
    with TestBed() as bed:
        deployment = Deployment(bed, tmp_path / "hosts", small_config(tmp_path), LINKS)
        roles = deployment.follow_page(PAGE)
        assert sorted(roles) == [
            "orchestrator@orch",
            "relay@relay",
            "trainer@trainer",
            "validator@trainer",
            "worker@gpu1",
            "worker@gpu2",
        ]
        trainer = roles["trainer@trainer"]
        assert deployment.wait(trainer, 80) == 0, deployment.tails()
        # workers and validators stop by themselves once the trainer said the run is over
        for name in ("validator@trainer", "worker@gpu1", "worker@gpu2"):
            assert deployment.wait(roles[name], 30) == 0, deployment.tails()
        for name in ("orchestrator@orch", "relay@relay"):
            assert roles[name].proc.poll() is None, deployment.tails()

        run_dir = deployment.folder("trainer.lan") / "srv" / "swarm"
        report = json.loads((run_dir / "report.json").read_text())
        (run_dir / "report.json").unlink()
        report_out, export_out, verify_out = deployment.after_run(PAGE)
        again = json.loads((run_dir / "report.json").read_text())

    assert report["status"] == "completed" and report["mode"] == "swarm", report
    assert report["steps"] == 4
    assert report["ledger"]["verified"] and report["ledger"]["entries"] > 0
    swarm = report["swarm"]
    # both workers joined; with this little work, admission may keep one of them idle
    assert len(swarm["workers"]) == 2 and swarm["banned_nodes"] == [], swarm
    assert all(w["rejected"] == 0 for w in swarm["workers"]), swarm
    counts = swarm["submissions"]
    assert counts["rejected"] == 0 and counts["trained"] > 0, counts
    # everything accepted was trained or was still queued when the run ended
    never = counts["never_trained"]
    assert counts["accepted"] <= counts["trained"] + never["queued_at_end"], counts
    # the relay followed the origin, each worker held a version, and the workers followed
    # newer ones (on a loaded machine a worker that starts late may see the short run end
    # before the next version reaches it)
    assert re.search(r"relay: v\d+ ready", roles["relay@relay"].log.read_text())
    held = {}
    for name in ("worker@gpu1", "worker@gpu2"):
        log = roles[name].log.read_text()
        held[name] = {int(v) for v in re.findall(r": v(\d+) ready", log)}
        assert held[name], (name, log)
    assert len(held["worker@gpu1"] | held["worker@gpu2"]) >= 2, held
    # `swarmrl report` and the ledger commands of step 9, after the fact
    assert again["status"] == "completed" and again["ledger"]["verified"], again
    assert "the ledger (" in report_out
    exported = int(re.search(r"exported (\d+) ledger entries", export_out).group(1))
    assert exported >= report["ledger"]["entries"], export_out
    assert f"OK: {exported} entries, chain and signatures valid" in verify_out, verify_out
