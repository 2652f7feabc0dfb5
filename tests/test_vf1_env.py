"""verifiers 0.4 tasksets (``swarmrl.envs.vf1``): a taskset and harness the tests write
(``swarmrl.testing.vf1``), played on verifiers' subprocess runtime, its model calls answered by
swarmrl's torch engine through the token endpoint (``swarmrl.inference.token_endpoint``), the
trace turned into an episode and scored by the taskset's reward. Skipped where verifiers < 0.4 is installed (the classic path's
tests in test_tasks_libs.py run there instead)."""

from __future__ import annotations

import pytest
from packaging.version import Version

vf = pytest.importorskip("verifiers", reason="verifiers is not installed")
if Version(vf.__version__) < Version("0.4"):
    pytest.skip(f"verifiers {vf.__version__} is installed, not >=0.4", allow_module_level=True)


from swarmrl.config.env import EnvConfig  # noqa: E402
from swarmrl.envs import build_env  # noqa: E402
from swarmrl.errors import ConfigError, HarnessFailed, Invalid  # noqa: E402
from swarmrl.inference.engine import TorchEngine  # noqa: E402
from swarmrl.inference.token_endpoint import serve_engine  # noqa: E402
from swarmrl.model.prompts import decode_completion  # noqa: E402
from swarmrl.protocol import SamplingParams  # noqa: E402
from swarmrl.protocol.seeds import derive_seed  # noqa: E402
from swarmrl.testing.vf1 import char_policy, memorizing_engine, write_taskset  # noqa: E402

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def taskset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_taskset(tmp_path_factory.mktemp("taskset"))


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(tokenizer directory, tokenizer, engine): a random one-layer model."""
    path, tokenizer, model = char_policy(tmp_path_factory.mktemp("policy"))
    return path, tokenizer, TorchEngine(model, tokenizer)


def _env(taskset: str, mode: str = "check", timeout_s: float = 60.0):
    return build_env(
        EnvConfig(
            name="verifiers_v1",
            verifiers_env=taskset,
            verifiers_harness_args={"mode": mode},
            verifiers_timeout_s=timeout_s,
        )
    )


def test_harness_episodes_are_swarmrl_episodes_replayable_from_their_seed(taskset, policy):
    path, tokenizer, engine = policy
    env = _env(taskset)
    tasks = env.first("train", 3)
    seeds = [11, 12, 13]
    with serve_engine(engine, PARAMS) as endpoint:
        played = env.run_episodes(tasks, seeds, endpoint, path, PARAMS)
        again = env.run_episodes(tasks[:1], seeds[:1], endpoint, path, PARAMS)
    # same seed, same episode (alone or batched with others: the same tokens, log-probs
    # equal to float rounding)
    alone, batched = again[0].episode.segments, played[0].episode.segments
    assert [(g.tokens, g.turns) for g in alone] == [(g.tokens, g.turns) for g in batched]
    for a, b in zip(alone, batched, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    for task, seed, result in zip(tasks, seeds, played, strict=True):
        episode = result.episode
        # two model calls, the harness's "sure?" between them as an environment turn
        assert episode.model_turns() == 2
        roles = [t.role for _, t in episode.turns()]
        assert roles == ["context", "model", "env", "model"] or roles == [
            "context", "model", "context", "model"
        ]  # fmt: skip
        first = episode.segments[0]
        assert tokenizer.decode(first.span(first.turns[0])) == f"<u>{task.prompt}<a>"
        if roles[2] == "env":
            assert tokenizer.decode(first.span(first.turns[2])).endswith("<u>sure?<a>")
        # every call is the engine's seeded sample: call k replays from derive_seed(turn, seed, k)
        for k, call in enumerate(episode.calls()):
            [gen] = engine.generate([call.prompt_tokens], PARAMS, [derive_seed("turn", seed, k)])
            assert gen.output_tokens == call.output_tokens
            assert gen.logprobs == pytest.approx(call.logprobs, abs=1e-5)
        # the taskset's reward: the last reply is the answer
        last = decode_completion(tokenizer, episode.calls()[-1].output_tokens).strip()
        assert episode.reward == (1.0 if last == task.answer else 0.0)
        # the trusted side recomputes it from the trace, which must carry the episode's tokens
        assert env.score_episode(task, episode, result.trace).reward == episode.reward


def test_a_trace_that_is_not_the_episode_is_refused_on_the_trusted_side(taskset, policy):
    path, _, engine = policy
    env = _env(taskset)
    [task] = env.first("train", 1)
    with serve_engine(engine, PARAMS) as endpoint:
        [result] = env.run_episodes([task], [5], endpoint, path, PARAMS)
    segment = result.episode.segments[-1]
    forged = segment.model_copy(update={"tokens": [*segment.tokens[:-1], 7]})
    episode = result.episode.model_copy(
        update={"segments": [*result.episode.segments[:-1], forged]}
    )
    with pytest.raises(Invalid, match="the trace is not this episode"):
        env.score_episode(task, episode, result.trace)
    # the trace as it travels (its JSON record) scores as the object does
    record = result.trace.to_record(float_decimals=None)
    assert env.score_episode(task, result.episode, record) == env.score_episode(
        task, result.episode, result.trace
    )
    # a record whose model call names a node it does not have, or whose path loops, is refused
    broken = {**record, "calls": [{**record["calls"][0], "node": 10**6}]}
    with pytest.raises(Invalid, match="the trace is unreadable: .* names no node"):
        env.score_episode(task, result.episode, broken)
    first = record["calls"][0]["node"]
    nodes = [dict(n) for n in record["nodes"]]
    nodes[first]["parent"] = first
    with pytest.raises(Invalid, match="broken path"):
        env.score_episode(task, result.episode, {**record, "nodes": nodes})


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=80)


def test_a_tool_call_runs_in_the_harness_and_its_result_is_an_environment_turn(taskset, policy):
    path, tokenizer, _ = policy
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}</tool_call><eos>'
    engine = memorizing_engine(tokenizer, f"<u>3+4=<a>{call}<t>7<a>7<eos>")
    env = _env(taskset, mode="tools")
    task = env.task_for_id(3)
    assert task.prompt == "3+4="
    with serve_engine(engine, GREEDY) as endpoint:
        [result] = env.run_episodes([task], [3], endpoint, path, GREEDY)
    [segment] = result.episode.segments
    turns = [(t.role, tokenizer.decode(segment.span(t))) for t in segment.turns]
    # the harness ran calc(3+4) and answered "7" as a tool message; the model then answered
    assert turns == [
        ("context", "<u>3+4=<a>"),
        ("model", call),
        ("env", "<t>7<a>"),
        ("model", "7<eos>"),
    ]
    assert [m.content for m in result.trace.tool_messages] == ["7"]
    assert result.episode.reward == 1.0
    assert env.score_episode(task, result.episode, result.trace).reward == 1.0


def test_a_tool_call_that_does_not_parse_ends_the_episode_as_an_answer(taskset, policy):
    path, tokenizer, _ = policy
    broken = "<tool_call>{oops</tool_call><eos>"
    engine = memorizing_engine(tokenizer, f"<u>3+4=<a>{broken}")
    env = _env(taskset, mode="tools")
    task = env.task_for_id(3)
    with serve_engine(engine, GREEDY) as endpoint:
        [result] = env.run_episodes([task], [3], endpoint, path, GREEDY)
    # no tool ran: the unreadable call is the model's (wrong) answer, scored 0, and the episode
    # keeps the tokens the model sampled
    assert [tokenizer.decode(c.output_tokens) for c in result.episode.calls()] == [broken]
    assert result.trace.tool_messages == []
    assert result.episode.reward == 0.0


def test_a_harness_that_crashes_is_one_clear_error(taskset, policy):
    path, _, engine = policy
    env = _env(taskset, mode="crash")
    with serve_engine(engine, PARAMS) as endpoint, pytest.raises(HarnessFailed) as info:
        env.run_episodes(env.first("train", 1), [1], endpoint, path, PARAMS)
    message = str(info.value)
    assert "\n" not in message and "out of cheese" in message and "exited 3" in message


def test_a_harness_that_hangs_is_killed_at_its_timeout(taskset, policy):
    path, _, engine = policy
    env = _env(taskset, mode="hang", timeout_s=2.0)
    with serve_engine(engine, PARAMS) as endpoint, pytest.raises(HarnessFailed) as info:
        env.run_episodes(env.first("train", 1), [1], endpoint, path, PARAMS)
    assert "ran past its 2 s timeout" in str(info.value)


def test_configuration_errors_are_one_line(taskset, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="needs env.verifiers_env"):
        build_env(EnvConfig(name="verifiers_v1"))
    with pytest.raises(ConfigError, match="'no_such_taskset'") as info:
        build_env(EnvConfig(name="verifiers_v1", verifiers_env="no_such_taskset"))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="needs a container runtime"):
        build_env(EnvConfig(name="verifiers_v1", verifiers_env=taskset, verifiers_harness="codex"))
    # the classic interface is gone from verifiers 0.4: one line naming what to install
    with pytest.raises(ConfigError, match=r'pip install "verifiers<0.4"') as info:
        build_env(EnvConfig(name="verifiers", verifiers_env=taskset))
    assert "\n" not in str(info.value)
    # null and bash build their program with uv: without it, refused rather than letting
    # verifiers pip-install it into the user's site-packages
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="builds its program with uv"):
        build_env(EnvConfig(name="verifiers_v1", verifiers_env=taskset, verifiers_harness="null"))
