"""The ``code`` environment on the common problem-set formats, and the learnable ``code_tiny``;
completions run in the real sandbox."""

import json

import pytest

from swarmrl.config.env import EnvConfig, SandboxConfig
from swarmrl.envs import build_env, build_sandbox
from swarmrl.envs.code import CodeEnv, CodeTinyEnv, extract_code
from swarmrl.errors import DatasetError

pytest.importorskip("datasets", reason="datasets is in the 'tasks' extra")

FAST = SandboxConfig(cpu_s=1, wall_s=3.0)
APPS_ROWS = [
    {
        "question": "Read n and print n squared.",
        "input_output": json.dumps(
            {"inputs": ["3\n", "10\n", "0\n"], "outputs": ["9\n", "100\n", "0\n"]}
        ),
    },
    {
        "question": "Read two numbers on one line and print their sum.",
        "input_output": json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}),
    },
]
MBPP_ROWS = [
    {"text": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]},
    {"text": "Write neg(a).", "test_list": ["assert neg(2) == -2"]},
]


@pytest.fixture(scope="module")
def sandbox():
    return build_sandbox(FAST)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _task_with(env, needle):
    return next(env.task_for_id(i) for i in range(env.space_size()) if needle in env.problem(i)[0])


def test_extract_code_prefers_the_last_python_block():
    text = "plan\n```\nnot this\n```\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("print(4)") == "print(4)"


def test_stdin_stdout_cases_apps_style(tmp_path, sandbox):
    path = _jsonl(tmp_path / "apps.jsonl", APPS_ROWS)
    env = CodeEnv(path, sandbox, 0.5, problem_column="question", tests_column="input_output")
    square = _task_with(env, "squared")
    assert "```python" in square.prompt
    right = env.score(square, "Here:\n```python\nn = int(input())\nprint(n * n)\n```")
    assert right.reward == 1.0 and right.details["correct"] is True
    half = env.score(square, "```python\nn = int(input())\nprint(n * n if n < 5 else 0)\n```")
    assert half.reward == pytest.approx(2 / 3) and half.details["correct"] is False
    loop = env.score(square, "```python\nwhile True:\n    pass\n```")
    assert loop.reward == 0.0 and loop.details["verdict"] == "timeout"
    assert env.score(square, "no code at all").reward == 0.0


def test_assert_style_mbpp(tmp_path, sandbox):
    path = _jsonl(tmp_path / "mbpp.jsonl", MBPP_ROWS)
    env = CodeEnv(path, sandbox, 0.5, problem_column="text", tests_column="test_list")
    add = _task_with(env, "add(a, b)")
    assert env.score(add, "```python\ndef add(a, b):\n    return a + b\n```").reward == 1.0
    assert env.score(add, "```python\ndef add(a, b):\n    return a - b\n```").reward == 0.0


def test_code_rows_without_tests_are_one_line_errors(tmp_path, sandbox):
    path = _jsonl(tmp_path / "bad.jsonl", [MBPP_ROWS[0], {"text": "no tests here"}])
    with pytest.raises(DatasetError) as info:
        CodeEnv(path, sandbox, problem_column="text", tests_column="test_list")
    assert "row 2" in str(info.value) and "\n" not in str(info.value)
    path = _jsonl(
        tmp_path / "bad2.jsonl", [{"text": "t", "tests": {"inputs": ["1"], "outputs": []}}] * 2
    )
    with pytest.raises(DatasetError, match=r"row 1: 1 inputs but 0 outputs"):
        CodeEnv(path, sandbox, problem_column="text")


def test_code_tiny_rewards_valid_python_only(sandbox):
    env = CodeTinyEnv(sandbox)
    pid = next(p for p in range(env.space_size()) if env.coefficients(p) == (3, 17, "-"))
    task = env.task_for_id(pid)
    assert (task.prompt, task.answer) == ("y=3x-17;", "3*x-17")
    assert all(c in env.alphabet for c in task.prompt + task.answer)
    assert env.score(task, "3*x-17").reward == 1.0
    flawed = env.demonstration(task, flawed=True)
    assert flawed == "3x-17" and env.score(task, flawed).reward == 0.0  # a syntax error
    assert env.score(task, "x*x-17").reward == pytest.approx(1 / 8)  # right only at x = 0
    assert env.score(task, "3*x+17").reward == 0.0
    assert env.score(task, "").reward == 0.0


@pytest.mark.slow
def test_code_tiny_through_build_env_and_the_filter_verb(tmp_path, capsys):
    """`swarmrl filter` on a sandboxed environment writes rows the environment reads back."""
    import torch

    from swarmrl.config.model import TinyModelConfig
    from swarmrl.model import build_char_tokenizer, create_tiny_model, save_policy
    from swarmrl.trainer.cli import main

    torch.manual_seed(0)
    env = build_env(EnvConfig(name="code_tiny", sandbox=FAST))
    tok = build_char_tokenizer(env.alphabet)
    model = create_tiny_model(
        TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), tok
    )
    model_dir = save_policy(model, tok, tmp_path / "m")
    out = tmp_path / "kept.jsonl"
    common = [
        "--set",
        'env.name="code_tiny"',
        "--set",
        "env.sandbox.wall_s=3",
        "--set",
        "run.threads=1",
    ]
    args = ["--model", str(model_dir), "--out", str(out), "--n", "6", "--samples", "1", *common]
    assert main("filter", [*args, "--lo", "0", "--hi", "1"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and {"problem", "answer", "problem_id", "pass_rate"} <= set(rows[0])
    subset = build_env(EnvConfig(name="code_tiny", sandbox=FAST, train_subset=str(out)))
    assert [t.problem_id for t in subset.first("train", 10)] == [r["problem_id"] for r in rows]
    assert [t.prompt for t in subset.first("train", 10)] == [r["problem"] for r in rows]


def test_code_filter_output_is_a_dataset_the_env_reads_back(tmp_path, sandbox):
    from swarmrl.trainer.cli import kept_row

    path = _jsonl(tmp_path / "apps.jsonl", APPS_ROWS)
    config = dict(name="code", problem_column="question", tests_column="input_output", sandbox=FAST)
    env = build_env(EnvConfig(dataset=str(path), heldout_fraction=0.5, **config))
    task = env.task("train", 0)
    kept = tmp_path / "kept.jsonl"
    _jsonl(kept, [kept_row(env, task, 0.5), kept_row(env, env.task("heldout", 0), 0.5)])
    again = build_env(EnvConfig(dataset=str(kept), heldout_fraction=0.5, **config))
    assert sorted(again.problem(i) for i in range(2)) == sorted(env.problem(i) for i in range(2))
