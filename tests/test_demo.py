"""A short end-to-end colocated run: warm start, RL, report. Asserts the reward goes up.

The task is the demo's mechanism in miniature: 2-letter reversal where 60 % of the warm-start
demonstrations leave the string unreversed, so the warm-started policy is sometimes right and
RL has to tip the balance.
"""

import json

import pytest

from swarmrl.config import EMBEDDED_DEFAULT, load_config
from swarmrl.launch.cli import run_colocated_cli
from swarmrl.launch.report import read_metrics

SHORT = [
    'env.name="reverse"',
    "env.reverse_len=2",
    "model.tiny.hidden_size=64",
    "model.tiny.num_layers=2",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=128",
    "sft.steps=150",
    "sft.batch_size=64",
    "sft.lr=3e-3",
    "sft.train_examples=2000",
    "sft.label_noise=0.6",
    "rl.steps=25",
    "rl.prompts_per_step=16",
    "rl.group_size=8",
    "rl.lr=1e-3",
    "rl.sampling.max_new_tokens=4",
    "eval.n=50",
    "eval.control=false",
    "run.threads=1",
]


@pytest.mark.slow
def test_short_colocated_run_raises_reward(tmp_path):
    config = load_config(
        [EMBEDDED_DEFAULT],
        [
            *SHORT,
            f"run.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
            f"run.run_dir={json.dumps(str(tmp_path / 'runs'))}",
        ],
    )
    run_dir = run_colocated_cli(config, quiet=True)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(25))
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.05, (first, last)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["mode"] == "colocated" and report["steps"] == 25
    assert report["eval"]["n"] == 50
    assert report["eval"]["after"]["accuracy"] > report["eval"]["before"]["accuracy"]
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert json.loads((run_dir / "config.json").read_text())["env"]["name"] == "reverse"
    assert (run_dir / "policy" / "config.json").is_file()
