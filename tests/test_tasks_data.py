"""Datasets read through Hugging Face ``datasets``, answer formats, chat-templated prompts, and
the filtered training subset. Every dataset here is a small file the test writes."""

import json

import pytest

from swarmrl.config.env import EnvConfig
from swarmrl.envs import ArithEnv, MathEnv, SubsetEnv, build_env
from swarmrl.envs.data import gsm8k_answer, reference_answer
from swarmrl.errors import DatasetError, MissingPathError
from swarmrl.model.prompts import encode_prompt, render_prompt
from swarmrl.model.tokenizer import build_char_tokenizer

pytest.importorskip("datasets", reason="datasets is in the 'tasks' extra")

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 1,000 more. How many?", "answer": "3+1000\n#### 1,003"},
    {"question": "What is 6 times 7?", "answer": "6*7=42\n#### 42"},
    {"question": "Half of 10?", "answer": "10/2 = <<10/2=5>>5\n#### 5"},
]
MATH_ROWS = [
    {"problem": "Simplify $2/4$.", "solution": "We get $\\boxed{\\frac{1}{2}}$."},
    {"problem": "What is $3^2$?", "solution": "$3^2 = \\boxed{9}$"},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reference_answer_formats():
    assert gsm8k_answer("so 12\n#### 1,234 ") == "1234"
    assert reference_answer("blah \\boxed{\\frac{1}{2}} x", "auto") == "\\frac{1}{2}"
    assert reference_answer("#### 7", "auto") == "7"
    assert reference_answer("  13 ", "auto") == "13"
    assert reference_answer("no marker", "gsm8k") is None
    assert reference_answer("no box", "boxed") is None
    assert reference_answer("#### 7", "plain") == "#### 7"


def test_gsm8k_jsonl_with_question_answer_columns(tmp_path):
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    env = MathEnv(path, 0.34, problem_column="question", answer_format="gsm8k")
    by_answer = {env.problem(i)[1]: env.task_for_id(i) for i in range(env.space_size())}
    assert set(by_answer) == {"1003", "42", "5"}
    task = by_answer["1003"]
    assert task.prompt.startswith("Tom has 3 apples") and "\\boxed{}" in task.prompt
    assert env.score(task, "the total is \\boxed{1003}").reward == 1.0
    assert env.score(task, "the total is \\boxed{1,003}").reward == 1.0
    assert env.score(task, "#### 1003").reward == 0.0  # only the boxed answer counts
    assert env.score(by_answer["42"], "\\boxed{41}").reward == 0.0


def test_math_style_parquet_and_saved_directory_with_solution_column(tmp_path):
    import datasets

    data = datasets.Dataset.from_list(MATH_ROWS)
    data.to_parquet(str(tmp_path / "math.parquet"))
    data.save_to_disk(str(tmp_path / "saved"))
    folder = tmp_path / "folder"
    folder.mkdir()
    _write_jsonl(folder / "part-0.jsonl", MATH_ROWS)
    for source in (tmp_path / "math.parquet", tmp_path / "saved", folder):
        env = build_env(
            EnvConfig(
                name="math", dataset=str(source), answer_column="solution", heldout_fraction=0.5
            )
        )
        answers = sorted(env.problem(i)[1] for i in range(env.space_size()))
        assert answers == ["9", "\\frac{1}{2}"], source
        half = next(env.task_for_id(i) for i in range(2) if env.problem(i)[1] != "9")
        assert env.score(half, "\\boxed{0.5}").reward == 1.0


def test_missing_column_is_one_line_naming_row_column_and_key(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", GSM8K_ROWS)
    with pytest.raises(DatasetError) as info:
        MathEnv(path)  # default problem_column 'problem' is not there
    message = str(info.value)
    assert "\n" not in message
    assert f"{path} row 1" in message and "'problem'" in message and "env.problem_column" in message
    assert "question" in message  # says which columns there are


def test_answer_without_the_configured_marker_names_the_row(tmp_path):
    rows = [GSM8K_ROWS[0], {"question": "q", "answer": "forty-two"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError, match=r"row 2: no gsm8k answer in 'answer'"):
        MathEnv(path, problem_column="question", answer_format="gsm8k")


def test_missing_local_file_and_unreadable_file(tmp_path):
    with pytest.raises(MissingPathError, match="nope.parquet"):
        MathEnv(tmp_path / "nope.parquet")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="bad.parquet: cannot read dataset"):
        MathEnv(bad)


def test_hub_id_offline_is_a_one_line_error(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetError) as info:
        MathEnv("nobody-at-all/no-such-dataset")
    assert "nobody-at-all/no-such-dataset" in str(info.value) and "\n" not in str(info.value)


CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


def test_chat_template_renders_system_and_user_and_is_the_one_layout():
    """With a chat template, every path gets the template's ids; without one, <bos> + text."""
    from swarmrl.roles.worker.rollouts import unit_prompts
    from swarmrl.trainer.sft import encode_examples

    env = build_env(EnvConfig(name="arith", digits=1, system_prompt="add"))
    task = env.task("train", 0)
    assert task.system == "add"
    plain = build_char_tokenizer("0123456789+=<>/adsuy\n")
    assert plain.decode(encode_prompt(plain, task)) == "<bos>add\n\n" + task.prompt

    chat = build_char_tokenizer("0123456789+=<>/adsuy\n")
    chat.chat_template = CHAT_TEMPLATE
    rendered = render_prompt(chat, task.prompt, task.system)
    assert rendered == f"<s>add<u>{task.prompt}<a>"
    ids = encode_prompt(chat, task)
    assert chat.decode(ids) == rendered and ids[0] != chat.bos_token_id

    class Unit:  # the fields of a work unit the worker's prompt layout reads
        task_indices = [0, 1]
        samples_per_task = 2

    worker = unit_prompts(env, chat, Unit())  # type: ignore[arg-type]
    assert [ids for _, ids in worker[:2]] == [ids, ids]
    sft = encode_examples(chat, [task], ["5"])
    assert sft.input_ids[0, : len(ids)].tolist() == ids


def test_train_subset_trains_on_listed_ids_and_keeps_heldout(tmp_path):
    base = ArithEnv(digits=2)
    keep = [base.problem_id("train", i) for i in (5, 1, 9)]
    path = tmp_path / "kept.jsonl"
    _write_jsonl(path, [{**base.record(pid), "problem_id": pid, "pass_rate": 0.5} for pid in keep])
    env = build_env(EnvConfig(name="arith", digits=2, train_subset=str(path)))
    assert isinstance(env, SubsetEnv)
    assert [t.problem_id for t in env.first("train", 10)] == keep
    assert {t.problem_id for t in env.sample("train", 30, seed=1)} <= set(keep)
    assert env.first("heldout", 5) == base.first("heldout", 5)
    assert env.task_for_id(keep[1]).index == 1

    heldout = base.problem_id("heldout", 0)
    _write_jsonl(path, [{"problem_id": keep[0]}, {"problem_id": heldout}])
    with pytest.raises(DatasetError, match="row 2: problem_id .* is a held-out task"):
        build_env(EnvConfig(name="arith", digits=2, train_subset=str(path)))
    _write_jsonl(path, [{"problem_id": "7"}])
    with pytest.raises(DatasetError, match="row 1: needs an integer 'problem_id'"):
        build_env(EnvConfig(name="arith", digits=2, train_subset=str(path)))
