"""Tasks from the libraries people already use: reasoning-gym generators and single-turn
``verifiers`` environments (the classic interface, verifiers < 0.4: skipped where 0.4 is
installed), scored on the trusted side."""

import textwrap

import pytest

from swarmrl.config.env import EnvConfig, ReasoningGymTask
from swarmrl.envs import build_env
from swarmrl.errors import ConfigError, DatasetError
from swarmrl.trainer.cli import kept_row


def _gym(**kw):
    tasks = [
        ReasoningGymTask(name="leg_counting", weight=3),
        ReasoningGymTask(name="basic_arithmetic"),
    ]
    return build_env(EnvConfig(name="reasoning_gym", tasks=tasks, size=200, **kw))


def test_reasoning_gym_weighted_disjoint_reproducible_split():
    pytest.importorskip("reasoning_gym")
    env, again = _gym(), _gym()
    heldout = {env.problem_id("heldout", i) for i in range(env.split_size("heldout"))}
    train = {env.problem_id("train", i) for i in range(env.split_size("train"))}
    assert not heldout & train and len(heldout | train) == 200
    assert env.first("heldout", 20) == again.first("heldout", 20)  # same on every process
    names = [env.task_names[env.generator_of(i)] for i in range(200)]
    assert 0.6 < names.count("leg_counting") / 200 < 0.9  # weight 3 : 1
    other = _gym(seed=1)
    assert [t.prompt for t in other.first("train", 5)] != [t.prompt for t in env.first("train", 5)]


def test_reasoning_gym_scores_with_the_library():
    pytest.importorskip("reasoning_gym")
    env = _gym()
    task = env.task("train", 0)
    assert "<answer>" in task.prompt
    right = env.score(task, f"thinking... <answer>{task.answer}</answer>")
    assert right.reward == 1.0 and right.details["correct"] is True
    assert env.score(task, "<answer>definitely wrong</answer>").reward < 1.0
    assert env.score(task, task.answer).reward == 0.0  # no answer tags: nothing to score


def test_reasoning_gym_partial_credit_can_be_turned_off():
    pytest.importorskip("reasoning_gym")
    arithmetic = [
        ReasoningGymTask(name="basic_arithmetic", config={"min_terms": 2, "max_terms": 2})
    ]
    kw = {"name": "reasoning_gym", "tasks": arithmetic, "size": 50}
    partial = build_env(EnvConfig(**kw))
    exact = build_env(EnvConfig(**kw, partial_credit=False))
    task = partial.task("train", 0)
    padded = f"<answer>{task.answer}0</answer>"  # the right answer and a digit more: wrong
    assert 0.0 < partial.score(task, padded).reward < 1.0  # the library's partial credit
    assert exact.score(task, padded).reward == 0.0
    assert exact.score(task, padded).details["correct"] is False
    right = exact.score(task, f"<answer>{task.answer}</answer>")
    assert right.reward == 1.0 and right.details["correct"] is True


def test_reasoning_gym_flawed_demonstrations_forget_the_minus_sign_only():
    pytest.importorskip("reasoning_gym")
    signed = [ReasoningGymTask(name="basic_arithmetic", config={"min_terms": 2, "max_terms": 2})]
    env = build_env(EnvConfig(name="reasoning_gym", tasks=signed, size=200))
    tasks = [env.task("train", i) for i in range(60)]
    negative = [t for t in tasks if t.answer.startswith("-")]
    positive = [t for t in tasks if not t.answer.startswith("-")]
    assert negative and positive
    for task in negative:
        assert env.demonstration(task) == f"<answer>{task.answer}</answer>"
        assert env.demonstration(task, flawed=True) == f"<answer>{task.answer[1:]}</answer>"
        assert env.score(task, env.demonstration(task, flawed=True)).details["correct"] is False
    for task in positive:  # nothing to forget: the flawed demonstration is right
        assert env.demonstration(task, flawed=True) == env.demonstration(task)
    # the built-in tiny model reads every prompt the generator writes
    assert all(set(t.prompt + t.answer) <= set(env.alphabet) for t in tasks)


def test_reasoning_gym_unknown_task_and_bad_config_are_one_line_errors():
    pytest.importorskip("reasoning_gym")
    with pytest.raises(ConfigError, match="unknown reasoning-gym task 'leg_countin'") as info:
        build_env(EnvConfig(name="reasoning_gym", tasks=[ReasoningGymTask(name="leg_countin")]))
    assert "\n" not in str(info.value)
    bad = ReasoningGymTask(name="leg_counting", config={"no_such_option": 1})
    with pytest.raises(ConfigError, match="'leg_counting'"):
        build_env(EnvConfig(name="reasoning_gym", tasks=[bad]))
    with pytest.raises(ConfigError, match="env.tasks"):
        build_env(EnvConfig(name="reasoning_gym"))


def test_reasoning_gym_filter_rows_read_back_as_a_subset(tmp_path):
    pytest.importorskip("reasoning_gym")
    import json

    env = _gym()
    keep = env.first("train", 4)
    path = tmp_path / "kept.jsonl"
    path.write_text("".join(json.dumps(kept_row(env, t, 0.5)) + "\n" for t in keep))
    subset = _gym(train_subset=str(path))
    assert subset.first("train", 10) == [subset.task_for_id(t.problem_id) for t in keep]
    assert [t.prompt for t in subset.first("train", 10)] == [t.prompt for t in keep]


VF_MODULE = """
import verifiers as vf
from datasets import Dataset

def load_environment(turns=1, few_shot=False):
    rows = [{"question": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(10)]
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def exact(completion, answer, parser, **kwargs):
        return 1.0 if parser.parse_answer(completion) == answer else 0.0

    def has_tag(completion, **kwargs):
        return 1.0 if "<answer>" in str(completion) else 0.0

    rubric = vf.Rubric(funcs=[exact, has_tag], weights=[1.0, 0.5], parser=parser)
    kwargs = dict(dataset=Dataset.from_list(rows), system_prompt="Answer in tags.",
                  parser=parser, rubric=rubric)
    if few_shot:
        kwargs["few_shot"] = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    if turns == 1:
        return vf.SingleTurnEnv(**kwargs)
    return Echo(max_turns=turns, **kwargs)


class Echo(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return []
"""


@pytest.fixture
def vf_module(tmp_path, monkeypatch):
    vf = pytest.importorskip("verifiers")
    if not hasattr(vf, "load_environment"):  # verifiers >= 0.4: test_vf1_env.py covers it
        pytest.skip(f"verifiers {vf.__version__} has no classic environments (needs <0.4)")
    (tmp_path / "swarmrl_vf_tiny.py").write_text(textwrap.dedent(VF_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "swarmrl_vf_tiny"


def test_verifiers_single_turn_env_scored_by_its_rubric(vf_module):
    env = build_env(EnvConfig(name="verifiers", verifiers_env=vf_module))
    assert env.space_size() == 10
    task = env.task("train", 0)
    assert task.system == "Answer in tags." and task.prompt.startswith("What is ")
    right = env.score(task, f"<answer>{task.answer}</answer>")
    assert right.reward == 1.0 and right.details["raw_reward"] == 1.5  # clipped weighted sum
    assert env.score(task, "<answer>-1</answer>").reward == 0.5
    assert env.score(task, "no tags").reward == 0.0
    heldout = {env.problem_id("heldout", i) for i in range(env.split_size("heldout"))}
    assert task.problem_id not in heldout
    override = build_env(EnvConfig(name="verifiers", verifiers_env=vf_module, system_prompt="S"))
    assert override.task("train", 0).system == "S"


def test_verifiers_unsupported_environments_are_one_line_errors(vf_module):
    with pytest.raises(ConfigError, match="only single-turn environments are supported"):
        build_env(EnvConfig(name="verifiers", verifiers_env=vf_module, verifiers_args={"turns": 3}))
    with pytest.raises(DatasetError, match=r"row 1: prompt must be \[system\?, user\]"):
        build_env(
            EnvConfig(name="verifiers", verifiers_env=vf_module, verifiers_args={"few_shot": True})
        )
    with pytest.raises(ConfigError, match="'no_such_vf_env'") as info:
        build_env(EnvConfig(name="verifiers", verifiers_env="no_such_vf_env"))
    assert "\n" not in str(info.value)


def test_verifiers_v1_names_the_version_it_needs(vf_module):
    with pytest.raises(ConfigError, match=r"needs verifiers>=0.4,<0.5 \(installed: 0\.") as info:
        build_env(EnvConfig(name="verifiers_v1", verifiers_env=vf_module))
    assert "\n" not in str(info.value)
