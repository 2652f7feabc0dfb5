"""Multi-turn episodes: the token layout, the loss mask, splitting at a re-rendered chat
template, batched generation, and the trusted side's check of a claimed episode."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from swarmrl.config.model import TinyModelConfig
from swarmrl.envs import GuessEnv, Score, Task, ToolArithEnv
from swarmrl.envs.multiturn import Message, MultiTurnEnvironment, Reply
from swarmrl.inference.engine import TorchEngine
from swarmrl.model import build_char_tokenizer, create_tiny_model
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.episodes import Episode, EpisodeSegment, EpisodeTurn
from swarmrl.rl import clipped_token_loss, importance_ratio
from swarmrl.trainer.batch import Completion, Group, collate
from swarmrl.trainer.episode_check import check_episode
from swarmrl.trainer.episodes import (
    demonstration_episode,
    episode_completions,
    run_episodes,
)

# --- the loss sees model tokens only ---------------------------------------------------------


def test_environment_tokens_get_no_gradient() -> None:
    # two episodes of one task: prompt [1, 5], then model [6, 7], env [8, 9], model [10, 2]
    def episode(reward: float) -> Completion:
        return Completion(
            prompt_tokens=[1, 5],
            output_tokens=[6, 7, 8, 9, 10, 2],
            behaviour_logprobs=[-0.1, -0.2, -0.3, -0.4],  # one per sampled token
            reward=reward,
            model_mask=[True, True, False, False, True, True],
        )

    batch = collate([Group(Task(0, "train", 0, "p", "a"), [episode(1.0), episode(0.0)])], 0)
    # position j predicts token j+1: positions 1..6 predict the output, 3 and 4 the env's
    assert batch.loss_mask[0].tolist() == [0, 1, 1, 0, 0, 1, 1]
    assert batch.behaviour_logp[0].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0, -0.3, -0.4])
    assert batch.advantages.flatten().tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    # the step's loss (swarmrl.trainer.step): Σ ℓ·mask / Σ mask, at logp = behaviour (ρ = 1)
    logp = batch.behaviour_logp.clone().requires_grad_(True)
    ratio = importance_ratio(logp, batch.behaviour_logp)
    token_loss, _ = clipped_token_loss(ratio, batch.advantages)
    ((token_loss * batch.loss_mask).sum() / batch.loss_tokens).backward()
    # dℓ/dlogp = −ρ·A = −A on each of the 8 loss tokens, divided by 8; exactly 0 elsewhere
    assert logp.grad is not None
    eighth = 1 / 8
    assert logp.grad[0].tolist() == pytest.approx(
        [0, -eighth, -eighth, 0, 0, -eighth, -eighth], abs=1e-5
    )
    assert logp.grad[1].tolist() == pytest.approx(
        [0, eighth, eighth, 0, 0, eighth, eighth], abs=1e-5
    )
    assert logp.grad[:, 3:5].abs().sum() == 0  # the environment's tokens: exactly none


def test_an_episode_split_in_segments_shares_one_advantage() -> None:
    task = Task(0, "train", 0, "p", "a")
    one = Completion([1], [4, 2], [-0.1, -0.1], 1.0, model_mask=[True, True])
    two = Completion([1, 3], [5, 2], [-0.1, -0.1], 1.0, model_mask=[True, True], continues=True)
    other = Completion([1], [6, 2], [-0.1, -0.1], 0.0)
    group = Group(task, [one, two, other])
    assert group.rewards == [1.0, 0.0]  # two members, not three
    batch = collate([group], 0)
    assert batch.advantages.flatten().tolist() == pytest.approx([1.0, 1.0, -1.0], abs=1e-5)


# --- layout and the split at a re-rendered chat template --------------------------------------


def test_tool_arith_episode_layout_and_mask() -> None:
    env = ToolArithEnv()
    tok = build_char_tokenizer(env.alphabet)
    task = env.task("train", 3)
    a, b = env.operands(task.problem_id)
    seg = demonstration_episode(env, tok, task, flawed=False).segments[0]
    spans = [(t.role, tok.decode(seg.span(t))) for t in seg.turns]
    assert spans == [
        ("context", f"<bos>{a}*{b}="),
        ("model", f"c({a}*{b})<eos>"),
        ("env", f"[{a * b}]"),
        ("model", f"{a * b}<eos>"),
    ]
    mask = seg.model_mask()
    assert [tok.decode([t]) for t, m in zip(seg.tokens, mask, strict=True) if m] == list(
        f"c({a}*{b})"
    ) + ["<eos>"] + list(str(a * b)) + ["<eos>"]


# A template that, like Qwen3's, drops an earlier answer's reasoning (the text before "|") once
# later turns exist: the prompt after such a turn does not extend the tokens the model saw.
THINKING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<a>{{ m.content.split('|')[-1] }}<eos>"
    "{%- else -%}<u>{{ m.content }}</u>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<a>{%- endif -%}"
)


class Chatter(MultiTurnEnvironment):
    """Answers every turn with ``ok``; three model turns; reward 1 (the split is under test)."""

    name = "chatter"
    alphabet = "abcdqrxyz<>/u|ok"
    max_turns = 3
    token_budget = 200

    def space_size(self) -> int:
        return 10

    def problem(self, problem_id: int) -> tuple[str, str]:
        return "q", "a"

    def reply(self, task: Task, seed: int, transcript: Sequence[Message]) -> Reply:
        return Reply("ok")

    def score_episode(self, task: Task, seed: int, transcript: Sequence[Message]) -> Score:
        return Score(1.0, {"correct": True, "turns": len(transcript)})

    def demonstration_turns(self, task: Task, flawed: bool = False) -> list[str]:
        return ["a", "x|b", "c"]


def test_episode_splits_where_the_template_rerenders_an_earlier_turn() -> None:
    env = Chatter()
    tok = build_char_tokenizer(env.alphabet)
    tok.chat_template = THINKING_TEMPLATE
    episode = demonstration_episode(env, tok, env.task("train", 0), flawed=False)
    decoded = [[(t.role, tok.decode(seg.span(t))) for t in seg.turns] for seg in episode.segments]
    # turn "a" re-renders as it was sampled: the next prompt extends it (one sequence); turn
    # "x|b" re-renders as "b": the third prompt does not extend it, so a second segment starts
    # whose context is that prompt, and "x|b" is trained only where the model saw it
    assert decoded == [
        [
            ("context", "<u>q</u><a>"),
            ("model", "a<eos>"),
            ("env", "<u>ok</u><a>"),
            ("model", "x|b<eos>"),
        ],
        [
            ("context", "<u>q</u><a>a<eos><u>ok</u><a>b<eos><u>ok</u><a>"),
            ("model", "c<eos>"),
        ],
    ]
    completions = episode_completions(episode.model_copy(update={"reward": 1.0}), 0, True)
    assert [c.continues for c in completions] == [False, True]
    assert [c.sampled_tokens for c in completions] == [6, 2]


# --- generation: batched across episodes ------------------------------------------------------


class CountingEngine(TorchEngine):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.batches: list[int] = []

    def generate(self, prompts, params, seeds, *, return_hidden=False):  # type: ignore[no-untyped-def]
        self.batches.append(len(prompts))
        return super().generate(prompts, params, seeds, return_hidden=return_hidden)


def test_episodes_are_generated_batched_and_equal_one_at_a_time() -> None:
    env = GuessEnv(n=32, max_turns=4, token_budget=40)
    tok = build_char_tokenizer(env.alphabet)
    torch.manual_seed(0)
    engine = CountingEngine(create_tiny_model(TinyModelConfig(), tok), tok)
    params = SamplingParams(max_new_tokens=3, stop_token_ids=(tok.eos_token_id,))
    tasks, seeds = env.sample("train", 6, 1), list(range(100, 106))
    together = run_episodes(env, engine, tok, tasks, seeds, params)
    assert len(engine.batches) <= env.max_turns  # one engine call per turn, not per episode
    assert engine.batches[0] == 6
    alone = [
        run_episodes(env, engine, tok, [t], [s], params)[0]
        for t, s in zip(tasks, seeds, strict=False)
    ]
    for batched, single in zip(together, alone, strict=True):  # same tokens, same turns
        one, other = batched.episode().segments[0], single.episode().segments[0]
        assert (one.tokens, one.turns) == (other.tokens, other.turns)
        assert one.logprobs == pytest.approx(other.logprobs, abs=1e-4)


# --- the trusted side's check ------------------------------------------------------------------


def _honest() -> tuple[ToolArithEnv, object, Task, Episode]:
    env = ToolArithEnv()
    tok = build_char_tokenizer(env.alphabet)
    task = env.task("train", 3)
    return env, tok, task, demonstration_episode(env, tok, task, flawed=False)


def _retokenise(episode: Episode, tokens: list[int], turns: list[tuple[str, int]]) -> Episode:
    spans, at = [], 0
    for role, n in turns:
        spans.append(EpisodeTurn(role=role, start=at, end=at + n))  # type: ignore[arg-type]
        at += n
    model = sum(n for role, n in turns if role == "model")
    seg = EpisodeSegment(tokens=tokens, turns=spans, logprobs=[0.0] * model)
    return Episode(seed=episode.seed, segments=[seg])


def test_check_accepts_the_honest_episode() -> None:
    env, tok, task, episode = _honest()
    assert check_episode(env, tok, task, episode, 12) is None


def test_check_rejects_a_forged_tool_result() -> None:
    env, tok, task, episode = _honest()
    seg = episode.segments[0]
    ctx, call, result, answer = (seg.span(t) for t in seg.turns)
    forged_result = tok.encode("[123]", add_special_tokens=False)
    forged_answer = tok.encode("123", add_special_tokens=False) + [tok.eos_token_id]
    forged = _retokenise(
        episode,
        ctx + call + forged_result + forged_answer,
        [("context", len(ctx)), ("model", len(call)), ("env", 5), ("model", 4)],
    )
    rejection = check_episode(env, tok, task, forged, 12)
    assert rejection is not None and rejection.reason == "env_mismatch"
    assert "turn 2" in rejection.detail


def test_check_rejects_environment_tokens_claimed_as_model_tokens() -> None:
    env, tok, task, episode = _honest()
    seg = episode.segments[0]
    lengths = [t.end - t.start for t in seg.turns]
    relabelled = _retokenise(
        episode,
        seg.tokens,
        list(zip(["context", "model", "model", "model"], lengths, strict=False)),
    )
    rejection = check_episode(env, tok, task, relabelled, 12)
    assert rejection is not None and rejection.reason == "env_as_model"
    merged = _retokenise(
        episode,
        seg.tokens,
        [("context", lengths[0]), ("model", lengths[1] + lengths[2]), ("model", lengths[3])],
    )
    rejection = check_episode(env, tok, task, merged, 40)
    assert rejection is not None and rejection.reason == "model_past_stop"


def test_check_rejects_reordered_and_dropped_turns() -> None:
    env, tok, task, episode = _honest()
    seg = episode.segments[0]
    ctx, call, result, answer = (seg.span(t) for t in seg.turns)
    reordered = _retokenise(
        episode,
        ctx + result + call + answer,
        [("context", len(ctx)), ("env", len(result)), ("model", len(call)), ("model", len(answer))],
    )
    rejection = check_episode(env, tok, task, reordered, 12)
    assert rejection is not None and rejection.reason == "turn_order"
    dropped = _retokenise(episode, ctx + call, [("context", len(ctx)), ("model", len(call))])
    rejection = check_episode(env, tok, task, dropped, 12)
    assert rejection is not None and rejection.reason == "cut_short"
    extra = _retokenise(
        episode,
        seg.tokens + result + answer,
        [
            *((t.role, t.end - t.start) for t in seg.turns),
            ("env", len(result)),
            ("model", len(answer)),
        ],
    )
    rejection = check_episode(env, tok, task, extra, 12)
    assert rejection is not None and rejection.reason == "after_end"


def test_check_rejects_episodes_over_their_turn_or_token_budget() -> None:
    long_env = GuessEnv(n=32, max_turns=8, token_budget=64)
    tok = build_char_tokenizer(long_env.alphabet)
    task = long_env.task("train", 0)
    slow = demonstration_episode(long_env, tok, task, flawed=True)  # quarter steps: many turns
    assert slow.model_turns() > 6
    rejection = check_episode(GuessEnv(n=32, max_turns=6), tok, task, slow, 3)
    assert rejection is not None and rejection.reason == "over_turns"
    rejection = check_episode(GuessEnv(n=32, max_turns=8, token_budget=10), tok, task, slow, 3)
    assert rejection is not None and rejection.reason == "over_budget"
    assert check_episode(long_env, tok, task, slow, 3) is None


def test_check_rejects_a_flattering_game_reply() -> None:
    env = GuessEnv(n=32, max_turns=6)
    tok = build_char_tokenizer(env.alphabet)
    task = env.task("train", 0)
    honest = demonstration_episode(env, tok, task, flawed=False)
    assert check_episode(env, tok, task, honest, 3) is None
    seg = honest.segments[0]
    first_env = next(t for t in seg.turns if t.role == "env")
    tokens = list(seg.tokens)
    flipped = ">" if tok.decode(seg.span(first_env)) == "<" else "<"
    tokens[first_env.start] = tok.convert_tokens_to_ids(flipped)
    lied = honest.model_copy(update={"segments": [seg.model_copy(update={"tokens": tokens})]})
    rejection = check_episode(env, tok, task, lied, 3)
    assert rejection is not None and rejection.reason == "env_mismatch"


@pytest.mark.parametrize(
    ("turns", "logprobs", "message"),
    [
        ([("context", 0, 2), ("model", 3, 4)], [0.0], "not contiguous"),
        ([("context", 0, 2), ("env", 2, 1), ("model", 1, 4)], [0.0] * 3, "reversed"),
        ([("context", 0, 2), ("model", 2, 4)], [0.0], "1 log-probs for 2 model tokens"),
        ([("model", 0, 4)], [0.0] * 4, "opens with a context turn"),
        ([("context", 0, 2), ("model", 2, 3)], [0.0], "cover 3 of 4 tokens"),
    ],
)
def test_a_malformed_episode_is_refused_at_the_edge(
    turns: list[tuple[str, int, int]], logprobs: list[float], message: str
) -> None:
    body = {
        "seed": 1,
        "segments": [
            {
                "tokens": [1, 5, 6, 2],
                "turns": [{"role": r, "start": a, "end": b} for r, a, b in turns],
                "logprobs": logprobs,
            }
        ],
    }
    with pytest.raises(ValueError, match=message):
        Episode.model_validate(body)


def test_the_colocated_sampler_trains_on_episodes() -> None:
    from swarmrl.config.rl import RLConfig
    from swarmrl.trainer.rollout import RolloutSampler

    env = ToolArithEnv()
    tok = build_char_tokenizer(env.alphabet)
    torch.manual_seed(0)
    engine = CountingEngine(create_tiny_model(TinyModelConfig(), tok), tok)
    rl = RLConfig.model_validate(
        {"group_size": 4, "prompts_per_step": 3, "sampling": {"max_new_tokens": 12}}
    )
    groups = RolloutSampler(env, engine, tok, rl, seed=5).sample_groups(
        env.sample("train", 3, 0), step=0, round_=0, policy_version=0
    )
    assert engine.batches[0] == 12  # the step's 12 episodes in one engine call per turn
    assert [len(g.rewards) for g in groups] == [4, 4, 4]
    for completion in (c for g in groups for c in g.completions):
        assert completion.model_mask is not None
        assert len(completion.behaviour_logprobs) == completion.sampled_tokens
    batch = collate(groups, tok.pad_token_id)
    assert batch.loss_tokens == sum(c.sampled_tokens for g in groups for c in g.completions)
