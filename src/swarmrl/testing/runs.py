"""Short real runs for tests and benchmarks of the tools that read run directories: the shipped
``arith`` config with settings that make a run take seconds, started as a user starts it
(``python -m swarmrl.cli run …``) so that what the tools read is what a run writes.

Knows nothing about pytest or about what the tools do with the run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import swarmrl

ARITH = Path(swarmrl.__file__).resolve().parent / "configs" / "arith.toml"

# a small swarm (one worker, a validator) or colocated run of 1-digit addition: two RL steps
SWARM_SHORT = [
    "env.digits=1",
    "model.tiny.hidden_size=64",
    "model.tiny.num_layers=2",
    "model.tiny.intermediate_size=128",
    "sft.steps=60",
    "sft.batch_size=64",
    "rl.steps=2",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "rl.max_backfill_rounds=0",
    "eval.n=20",
    "eval.control=false",
    "eval.every=100",
    "swarm.workers=1",
    "swarm.rollouts_per_lease=8",
]

# steps of the swarm run the tests share (tests/conftest.py ``swarm_run``): enough for every
# count of its report to move
SWARM_RUN_STEPS = 5

# a tinier colocated run; the long context lets a served request generate for a while
# (``swarmrl serve`` tests stop one midway)
SERVE_SHORT = [
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64",
    "model.tiny.max_position_embeddings=4096",
    "sft.steps=5",
    "sft.batch_size=16",
    "sft.train_examples=200",
    "rl.steps=2",
    "rl.prompts_per_step=4",
    "rl.group_size=2",
    "eval.n=8",
    "eval.control=false",
]


def short_run(
    root: Path, settings: list[str], *extra: str, quiet: bool = True, timeout_s: float = 400
) -> tuple[Path, str]:
    """``swarmrl run`` of the shipped arith config with ``settings`` (then ``extra`` arguments,
    e.g. ``--colocated`` or more ``--set``), its cache and run directory under ``root``: the run
    directory it made and its console (stdout). A failed run raises with its output."""
    runs = root / "runs"
    before = set(runs.glob("*")) if runs.exists() else set()
    sets = [*settings, f"run.cache_dir={root / 'cache'}", f"run.run_dir={runs}"]
    argv = [sys.executable, "-m", "swarmrl.cli", "run", str(ARITH), *(["--quiet"] * quiet)]
    argv += [arg for item in sets for arg in ("--set", item)]
    done = subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"swarmrl run failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    (made,) = set(runs.glob("*")) - before
    return made, done.stdout


def logged_backend(log: str) -> str:
    """The inference backend a role's log says it was started with (its "resolved config" line
    names only what differs from the defaults); "?" where the log has no such line."""
    from swarmrl.config.inference import InferenceConfig

    resolved = re.search(r"resolved config (\{.*\})$", log, re.MULTILINE)
    if resolved is None:
        return "?"
    default = InferenceConfig.model_fields["backend"].default
    return json.loads(resolved.group(1)).get("inference", {}).get("backend", default)
