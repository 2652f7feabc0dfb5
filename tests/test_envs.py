import importlib.util
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from swarmrl.config.env import EnvConfig, LengthBudgetConfig
from swarmrl.envs import (
    ArithEnv,
    LengthBudgetEnv,
    MathEnv,
    ReverseEnv,
    Score,
    budget_reward,
    build_env,
)
from swarmrl.errors import ConfigError, DatasetError, MissingPathError

needs_datasets = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None, reason="datasets is in the 'tasks' extra"
)


@pytest.mark.parametrize(
    "env", [ArithEnv(digits=1), ArithEnv(digits=2, heldout_fraction=0.3), ReverseEnv(length=2)]
)
def test_split_is_a_disjoint_partition_of_the_space(env):
    heldout = [env.problem_id("heldout", i) for i in range(env.split_size("heldout"))]
    train = [env.problem_id("train", i) for i in range(env.split_size("train"))]
    assert len(set(heldout)) == len(heldout) and len(set(train)) == len(train)
    assert not set(heldout) & set(train)
    assert set(heldout) | set(train) == set(range(env.space_size()))
    assert len(heldout) == round(env.space_size() * env.heldout_fraction)
    for pid in heldout[:5] + train[:5]:
        assert env.task_for_id(pid).problem_id == pid


def test_sampling_is_deterministic_and_stays_in_its_split():
    env = ArithEnv(digits=2)
    a, b = env.sample("train", 50, seed=7), env.sample("train", 50, seed=7)
    assert a == b
    assert a != env.sample("train", 50, seed=8)
    heldout_ids = {env.problem_id("heldout", i) for i in range(env.split_size("heldout"))}
    assert all(t.problem_id not in heldout_ids and t.split == "train" for t in a)
    with pytest.raises(IndexError):
        env.task("heldout", env.split_size("heldout"))


def test_arith_prompt_answer_and_score():
    env = ArithEnv(digits=3)
    pid = next(p for p in range(env.space_size()) if env.operands(p) == (123, 456))
    prompt, answer = env.problem(pid)
    assert (prompt, answer) == ("123+456=", "975")
    task = env.task("train", 0)
    assert env.score(task, task.answer) == Score(1.0, {"correct": True})
    assert env.score(task, task.answer + "1").reward == 0.0
    assert env.score(task, task.answer[::-1] if len(set(task.answer)) > 1 else "x").reward == 0.0


def test_arith_flawed_demonstration_forgets_the_final_carry():
    env = ArithEnv(digits=3)

    def task_of(a, b):
        return env.task_for_id(
            next(p for p in range(env.space_size()) if env.operands(p) == (a, b))
        )

    assert env.demonstration(task_of(658, 467)) == "5211"
    assert env.demonstration(task_of(658, 467), flawed=True) == "521"  # leading 1 dropped
    assert env.demonstration(task_of(158, 267), flawed=True) == "524"  # no final carry: right


def test_reverse_partial_credit():
    env = ReverseEnv(length=4)
    task = env.task("heldout", 3)
    assert env.score(task, task.answer).reward == 1.0
    wrong_first = ("a" if task.answer[0] != "a" else "b") + task.answer[1:]
    assert env.score(task, wrong_first).reward == 0.75
    assert env.score(task, task.answer + "zz").reward == pytest.approx(4 / 6)
    assert env.score(task, "").reward == 0.0


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


@needs_datasets
def test_math_env_reads_jsonl_and_parquet_and_verifies(tmp_path):
    rows = [
        {"problem": "What is 1/2 + 1/4?", "answer": "3/4"},
        {"problem": "2+2?", "answer": 4},
        {"problem": "x", "answer": "\\frac{1}{3}"},
    ]
    jsonl = tmp_path / "d.jsonl"
    _write_jsonl(jsonl, rows)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in rows]), parquet)
    for path in (jsonl, parquet):
        env = MathEnv(path, heldout_fraction=0.34)
        assert env.space_size() == 3
        by_answer = {env.problem(i)[1]: env.task_for_id(i) for i in range(3)}
        assert "\\boxed{}" in by_answer["3/4"].prompt
        assert env.score(by_answer["3/4"], "so the answer is \\boxed{0.75}").reward == 1.0
        assert env.score(by_answer["3/4"], "\\boxed{0.7}").reward == 0.0
        assert env.score(by_answer["4"], "\\boxed{4}").reward == 1.0


@needs_datasets
def test_math_scores_only_the_final_boxed_answer(tmp_path):
    """A bare number anywhere in the text is not an answer: junk must not earn the reward."""
    path = tmp_path / "d.jsonl"
    _write_jsonl(path, [{"problem": "4+5?", "answer": 9}, {"problem": "1+1?", "answer": 2}])
    env = MathEnv(path, heldout_fraction=0.5)
    task = env.task_for_id(0)
    assert env.score(task, "a 9 b").reward == 0.0
    assert env.score(task, "9").reward == 0.0
    assert env.score(task, "\\boxed{}").reward == 0.0
    assert env.score(task, "first \\boxed{9} then \\boxed{8}").reward == 0.0
    assert env.score(task, "first \\boxed{8} then \\boxed{9}").reward == 1.0
    assert env.score(task, "\\boxed{\\frac{18}{2}}").reward == 1.0
    assert env.score(task, "unbalanced \\boxed{9").reward == 0.0


@needs_datasets
@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"problem": "p"}', "row 2: 'answer'"),
        ('{"problem": 3, "answer": "1"}', "row 2: 'problem'"),
        ("[1, 2]", "row 2: expected an object"),
        ("{bad json", "row 2: not valid JSON"),
    ],
)
def test_math_malformed_row_names_file_and_row(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "ok", "answer": "1"}\n' + line + "\n")
    with pytest.raises(DatasetError) as info:
        MathEnv(path)
    assert str(path) in str(info.value) and needle in str(info.value)


@needs_datasets
def test_math_missing_file_and_missing_setting(tmp_path):
    with pytest.raises(MissingPathError, match="nope.jsonl"):
        MathEnv(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="env.dataset"):
        build_env(EnvConfig(name="math"))


def test_budget_reward_modes():
    assert budget_reward(1.0, 8, 12, 0.1, "exact") == pytest.approx(0.6)
    assert budget_reward(1.0, 8, 4, 0.1, "exact") == pytest.approx(0.6)
    assert budget_reward(1.0, 8, 4, 0.1, "max") == 1.0  # undershoot is free
    assert budget_reward(1.0, 8, 12, 0.1, "max") == pytest.approx(0.6)
    assert budget_reward(0.5, 8, 12, 0.1, "clip") == pytest.approx(0.3)  # 0.5 · (1 − 0.4)
    assert budget_reward(0.5, 8, 12, 0.1, "exact") == pytest.approx(0.1)
    assert budget_reward(0.2, 8, 30, 0.1, "exact") == 0.0  # never below 0


def test_budget_wrapper_names_its_target_and_shapes_the_reward():
    env = build_env(
        EnvConfig(
            name="reverse",
            reverse_len=4,
            length_budget=LengthBudgetConfig(enabled=True, targets=[4, 9], alpha=0.1, mode="exact"),
        )
    )
    assert isinstance(env, LengthBudgetEnv)
    tasks = env.first("train", 40)
    targets = {t.meta["target_length"] for t in tasks}
    assert targets == {4, 9}
    for task in tasks[:5]:
        target = task.meta["target_length"]
        assert task.prompt.startswith(f"[{target}]")
        assert all(c in env.alphabet for c in task.prompt)
        score = env.score(task, task.answer, num_tokens=5)
        assert score.reward == pytest.approx(max(0.0, 1.0 - 0.1 * abs(target - 5)))
        assert score.details["task_reward"] == 1.0
    assert env.task("train", 3) == env.task("train", 3)
