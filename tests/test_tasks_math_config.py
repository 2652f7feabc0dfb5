"""The shipped bring-your-own example: ``configs/math.toml`` and its dataset file.

The dataset is made by ``configs/data/make_math_small.py`` from a documented rule; the math
environment builds a character alphabet from its rows, so a tiny model is created, warm-started
on the worked solutions and trained by RL without any downloaded tokenizer."""

import importlib.util
import json
from pathlib import Path

import pytest

from swarmrl.config.env import EnvConfig
from swarmrl.config.load import load_config
from swarmrl.envs import build_env
from swarmrl.errors import DatasetError
from swarmrl.model.prompts import encode_prompt
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.trainer.colocated import run_colocated
from swarmrl.trainer.warmstart import warm_start_digest

pytest.importorskip("datasets", reason="datasets is in the 'tasks' extra")
pytest.importorskip("math_verify", reason="math-verify is in the 'tasks' extra")

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "configs" / "data"
TINY_RUN = [
    "sft.steps=3",
    "sft.batch_size=4",
    "sft.train_examples=16",
    "rl.steps=1",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rl.sampling.max_new_tokens=8",
    "eval.n=4",
]


def _generator():
    spec = importlib.util.spec_from_file_location("make_math_small", DATA / "make_math_small.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_dataset_is_what_its_rule_makes_and_every_row_verifies():
    rows = [json.loads(line) for line in (DATA / "math-small.jsonl").read_text().splitlines()]
    assert rows == _generator().make_rows()
    assert len(rows) == 400 and len({r["problem"] for r in rows}) == 400
    config = load_config([REPO / "configs" / "math.toml"], [f"env.dataset={DATA}/math-small.jsonl"])
    env = build_env(config.env)
    tokenizer = build_char_tokenizer(env.alphabet)
    for task in env.first("train", 50) + env.first("heldout", 50):
        demo = env.demonstration(task)
        assert env.score(task, demo).reward == 1.0
        ids = encode_prompt(tokenizer, task) + tokenizer.encode(demo, add_special_tokens=False)
        assert tokenizer.unk_token_id not in ids
    assert env.score(task, task.answer).reward == 0.0  # a bare number is not the boxed answer


def test_a_solution_that_does_not_box_the_answer_names_the_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    rows = [
        {"problem": "What is 2 + 2?", "answer": "4", "solution": "2 + 2 = 4. \\boxed{4}"},
        {"problem": "What is 3 + 3?", "answer": "6", "solution": "3 + 3 = 6. \\boxed{5}"},
    ]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match="row 2: the solution in 'solution'"):
        build_env(EnvConfig(name="math", dataset=str(bad), solution_column="solution"))


def test_warm_start_digest_follows_the_dataset_bytes(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text((DATA / "math-small.jsonl").read_text())
    config = load_config([REPO / "configs" / "math.toml"], [f"env.dataset={data}"])
    before = warm_start_digest(config)
    data.write_text(data.read_text().replace('"answer": "91"', '"answer": "92"', 1))
    assert warm_start_digest(config) != before


def test_math_config_runs_warm_start_rl_and_eval(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config's dataset path is taken from the config's folder
    config = load_config(
        [REPO / "configs" / "math.toml"], [*TINY_RUN, f"run.cache_dir={tmp_path / 'cache'}"]
    )
    run = run_colocated(config)
    assert run.result.steps == 1
    assert run.result.warm_start["steps"] == 3 and not run.result.warm_start["cached"]
    assert set(run.result.evals) == {"before", "after"}
    assert run.result.evals["after"]["n"] == 4
    assert run.result.history[0]["groups_sampled"] >= 1


def test_length_budget_on_the_math_dataset_keeps_the_written_instruction():
    config = EnvConfig(
        name="math",
        dataset=str(DATA / "math-small.jsonl"),
        answer_format="plain",
        solution_column="solution",
        length_budget={"enabled": True, "targets": [24]},
    )
    env = build_env(config)
    task = env.first("train", 1)[0]
    assert task.prompt.startswith("Answer in about 24 tokens.\n")
    tokenizer = build_char_tokenizer(env.alphabet)
    assert tokenizer.unk_token_id not in encode_prompt(tokenizer, task)
