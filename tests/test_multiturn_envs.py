"""The multi-turn tasks, the tool-call format and the tools, as text (no model)."""

from __future__ import annotations

import math

import pytest

from swarmrl.config import SwarmConfig, load_config
from swarmrl.envs import GuessEnv, ToolArithEnv, build_env
from swarmrl.envs.multiturn import (
    Calculator,
    Message,
    PythonTool,
    ToolCall,
    parse_tool_call,
)
from swarmrl.envs.sandbox import Limits, Sandbox
from swarmrl.errors import ConfigError, SandboxError, ToolError


def test_tool_calls_parse_in_both_formats() -> None:
    assert parse_tool_call("c(347*582)") == ToolCall("c", "347*582")
    hermes = '<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
    assert parse_tool_call(hermes) == ToolCall("calc", "2*3")
    assert parse_tool_call("<tool_call>{not json</tool_call>") == ToolCall("", "")
    assert parse_tool_call("201954") is None  # an answer, not a call


def test_calculator_computes_integers_and_refuses_anything_else() -> None:
    calc = Calculator()
    assert calc.call("347*582") == "201954"
    assert calc.call("-(2+3)*4") == "-20"
    for bad in ("__import__('os')", "2**999", "1/0", "", "9" * 20):
        with pytest.raises(ToolError):
            calc.call(bad)


def test_python_tool_runs_in_the_sandbox() -> None:
    try:
        sandbox = Sandbox(Limits(cpu_s=1, wall_s=2.0))
    except SandboxError as exc:
        pytest.skip(f"no sandbox here: {exc}")
    tool = PythonTool(sandbox)
    assert tool.call("print(6 * 7)") == "42"
    with pytest.raises(ToolError, match="timeout"):
        tool.call("while True: pass")


def test_tool_arith_replies_to_calls_and_scores_the_answer() -> None:
    env = ToolArithEnv()
    task = next(t for t in env.first("heldout", 50) if int(t.answer) % 1000)
    a, b = env.operands(task.problem_id)
    call = Message("model", f"c({a}*{b})")
    assert env.reply(task, 0, [call]).text == f"[{a * b}]"
    assert env.reply(task, 0, [Message("model", "c(1/0)")]).text == "[?]"
    assert env.reply(task, 0, [Message("model", f"x({a}*{b})")]).text == "[?]"
    answer = Message("model", str(a * b))
    assert env.reply(task, 0, [call, Message("env", f"[{a * b}]"), answer]).done
    score = env.score_episode(task, 0, [call, Message("env", f"[{a * b}]"), answer])
    assert score.reward == 1.0 and score.details["called_tool"] is True
    assert env.score(task, str(round(a * b, -3))).reward == 0.0  # the warm start's mistake


def test_guess_feedback_and_the_bisecting_demonstration() -> None:
    env = GuessEnv(n=32, max_turns=6)
    for index in range(env.split_size("train")):
        task = env.task("train", index)
        turns = env.demonstration_turns(task)
        hidden = int(task.answer)
        assert turns[-1] == str(hidden)
        assert len(turns) <= math.ceil(math.log2(33))  # bisection's worst case
        transcript, lo, hi = [], 1, 32
        for text in turns:
            transcript.append(Message("model", text))
            reply = env.reply(task, 0, transcript)
            if not reply.done:
                guess = int(text)
                lo, hi = (lo, guess - 1) if hidden < guess else (guess + 1, hi)
                assert reply.text == f"{'<' if hidden < guess else '>'}{lo}-{hi}"
                transcript.append(Message("env", reply.text))
        score = env.score_episode(task, 0, transcript)
        assert score.details["correct"] and score.reward == 1.0 - 0.5 * (len(turns) - 1) / 6
    assert env.reply(env.task("train", 0), 0, [Message("model", "99")]).text == "?1-32"


def test_guess_with_starting_ranges_holds_out_pairs_and_plays_from_the_range() -> None:
    n = 12
    env = GuessEnv(n=n, max_turns=5, ranges=True)
    every = {
        ((lo, hi), h)
        for lo in range(1, n + 1)
        for hi in range(lo + 1, n + 1)
        for h in range(lo, hi + 1)
    }
    problems = {
        split: [env.task(split, i) for i in range(env.split_size(split))]
        for split in ("train", "heldout")
    }
    pairs = {
        split: {env.start_and_hidden(t.problem_id) for t in tasks}
        for split, tasks in problems.items()
    }
    assert pairs["train"] | pairs["heldout"] == every and not pairs["train"] & pairs["heldout"]
    assert {h for _, h in pairs["train"]} == set(range(1, n + 1))  # every number trains somewhere
    for task in problems["heldout"]:
        (lo, hi), hidden = env.start_and_hidden(task.problem_id)
        assert (task.prompt, task.answer) == (f"{lo}-{hi}?", str(hidden))
        assert env.task_for_id(task.problem_id).split == "heldout"
        turns = env.demonstration_turns(task)
        assert turns[-1] == str(hidden) and len(turns) <= math.ceil(math.log2(hi - lo + 2))
        transcript = [Message("model", turns[0])]
        if len(turns) > 1:  # the feedback restates what is left of the starting range
            guess = int(turns[0])
            left = (lo, guess - 1) if hidden < guess else (guess + 1, hi)
            assert (
                env.reply(task, 0, transcript).text
                == f"{'<' if hidden < guess else '>'}{left[0]}-{left[1]}"
            )
    with pytest.raises(ValueError, match="n <= 1024"):
        GuessEnv(n=2048, ranges=True)
    config = SwarmConfig.model_validate(
        {"env": {"name": "guess", "guess_n": 8, "guess_ranges": True}}
    )
    assert build_env(config.env).space_size() == sum(L * (9 - L) for L in range(2, 9))


def test_multiturn_config_keys_build_the_tasks() -> None:
    config = SwarmConfig.model_validate(
        {"env": {"name": "guess", "guess_n": 64, "max_turns": 7, "token_budget": 50}}
    )
    env = build_env(config.env)
    assert isinstance(env, GuessEnv) and (env.n, env.max_turns, env.token_budget) == (64, 7, 50)
    env = build_env(SwarmConfig.model_validate({"env": {"name": "tool_arith"}}).env)
    assert isinstance(env, ToolArithEnv) and env.max_turns == 3
    budget = {"env": {"name": "guess", "length_budget": {"enabled": True}}}
    with pytest.raises(ConfigError, match="multi-turn"):
        build_env(SwarmConfig.model_validate(budget).env)


def test_configs_load_and_tool_arith_runs_as_a_swarm_with_a_forger() -> None:
    for name in ("tool_arith", "guess"):
        config = load_config([f"configs/{name}.toml"], [])
        assert config.env.name == name
    # the swarm run itself: tests/test_episode_swarm_e2e.py
    assert load_config(["configs/tool_arith.toml"], []).swarm.cheaters == ["forge_env_after:2"]
