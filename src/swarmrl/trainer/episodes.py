"""Episodes at token level: render each turn's prompt, run episodes batched, train on them.

The prompt of model call k is the conversation so far, rendered by :func:`turn_prompt`:

- a tokenizer without a chat template: the task's prompt ids (``swarmrl.model.prompts``), then
  each model turn's *sampled* ids (stop token included) and each environment turn's text
  encoded with no special tokens, so every prompt extends the one before exactly;
- a tokenizer with a chat template: ``[system?, user: prompt, assistant: model text,
  user: environment text, …]`` rendered with the generation prompt appended; where the
  template renders earlier turns differently once later ones exist, the prompt does not extend
  the tokens before it and the episode splits there (``swarmrl.protocol.episodes``).

:class:`EpisodeState.record` is the one rule of what follows a model turn, used by the driver
(:func:`run_episodes`) and by the check of an untrusted episode
(``swarmrl.trainer.episode_check``): the environment's reply; the episode ends when the reply
says so, after ``env.max_turns`` model turns, or when the environment's turn would leave no room
in ``env.token_budget`` (model + environment tokens) for another model token; otherwise the next
call may sample ``min(max_new_tokens, budget left)`` tokens. Call k of an episode samples with
``derive_seed("turn", episode_seed, k)``.

:func:`run_episodes` advances every unfinished episode one turn per engine call (batched
across episodes, not one at a time). :func:`episode_completions` turns an episode into the
trainer's completions (one per segment, environment tokens masked out of the loss).

Knows nothing about the optimizer or where episodes are sent.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from swarmrl.envs import Task
from swarmrl.envs.multiturn import Message, MultiTurnEnvironment
from swarmrl.inference.interface import Engine
from swarmrl.inference.types import Generation
from swarmrl.model.prompts import decode_completion, encode_prompt, has_chat_template
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.episodes import Episode, ModelCall, episode_from_calls
from swarmrl.protocol.seeds import derive_seed
from swarmrl.trainer.batch import Completion, Group
from swarmrl.trainer.sft import SFTData


def turn_prompt(
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    transcript: Sequence[Message],
    sampled: Sequence[Sequence[int]],
) -> list[int]:
    """Prompt ids of the next model call after ``transcript`` (module docstring); ``sampled``
    holds the ids of each model turn of it, in order."""
    if has_chat_template(tokenizer):
        messages = [{"role": "user", "content": task.prompt}]
        if task.system:
            messages.insert(0, {"role": "system", "content": task.system})
        for m in transcript:
            messages.append(
                {"role": "assistant" if m.speaker == "model" else "user", "content": m.text}
            )
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(str(text), add_special_tokens=False))
    ids = encode_prompt(tokenizer, task)
    turns = iter(sampled)
    for m in transcript:
        if m.speaker == "model":
            ids += list(next(turns))
        else:
            ids += list(tokenizer.encode(m.text, add_special_tokens=False))
    return ids


@dataclass
class EpisodeState:
    """An episode under way: its transcript, calls, and the next call's prompt and limit."""

    task: Task
    seed: int
    transcript: list[Message] = field(default_factory=list)
    calls: list[ModelCall] = field(default_factory=list)
    limits: list[int] = field(default_factory=list)  # [calls] tokens each call was allowed
    next_prompt: list[int] | None = None  # None: the episode has ended
    next_max: int = 0  # tokens the next call may sample
    used: int = 0  # budget tokens so far (model + environment turns)

    @property
    def ended(self) -> bool:
        return self.next_prompt is None

    def call_seed(self) -> int:
        return derive_seed("turn", self.seed, len(self.calls))

    def episode(self, reward: float | None = None) -> Episode:
        return episode_from_calls(self.calls, self.seed, reward)

    @classmethod
    def start(
        cls,
        env: MultiTurnEnvironment,
        tokenizer: PreTrainedTokenizerBase,
        task: Task,
        seed: int,
        max_new_tokens: int,
    ) -> EpisodeState:
        state = cls(task, seed)
        state.next_prompt = turn_prompt(tokenizer, task, [], [])
        state.next_max = min(max_new_tokens, env.token_budget)
        return state

    def record(
        self,
        env: MultiTurnEnvironment,
        tokenizer: PreTrainedTokenizerBase,
        output: Sequence[int],
        logprobs: Sequence[float],
        max_new_tokens: int,
    ) -> None:
        """Add the model turn ``output`` and what follows it (module docstring)."""
        if self.next_prompt is None:
            raise ValueError("the episode has ended")
        prompt, output = self.next_prompt, list(output)
        self.calls.append(ModelCall(prompt, output, list(logprobs)))
        self.limits.append(self.next_max)
        self.transcript.append(Message("model", decode_completion(tokenizer, output)))
        self.used += len(output)
        self.next_prompt = None
        reply = env.reply(self.task, self.seed, self.transcript)
        if reply.done or len(self.calls) >= env.max_turns:
            return
        with_reply = [*self.transcript, Message("env", reply.text)]
        sampled = [c.output_tokens for c in self.calls]
        following = turn_prompt(tokenizer, self.task, with_reply, sampled)
        before = prompt + output
        # an environment turn inside a re-rendered context (a split) is not a turn of its own
        env_tokens = len(following) - len(before) if following[: len(before)] == before else 0
        if self.used + env_tokens >= env.token_budget:
            return
        self.transcript = with_reply
        self.used += env_tokens
        self.next_prompt = following
        self.next_max = min(max_new_tokens, env.token_budget - self.used)


# called with each engine call's episodes, its generations and the parameters it sampled with
# (``max_new_tokens`` set to that call's limit), before the episodes record them
OnTurn = Callable[[list["EpisodeState"], list[Generation], SamplingParams], None]


def run_episodes(
    env: MultiTurnEnvironment,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    seeds: Sequence[int],
    params: SamplingParams,
    on_turn: OnTurn | None = None,
) -> list[EpisodeState]:
    """One episode per ``(task, seed)``, every unfinished one advanced a turn per engine call
    (one call per distinct token limit, usually one). ``on_turn``: sees every engine call's
    generations, with hidden states (a worker builds each call's proof there)."""
    states = [
        EpisodeState.start(env, tokenizer, t, s, params.max_new_tokens)
        for t, s in zip(tasks, seeds, strict=True)
    ]
    while True:
        active = [s for s in states if not s.ended]
        if not active:
            return states
        for limit in sorted({s.next_max for s in active}):
            batch = [s for s in active if s.next_max == limit]
            call_params = params.model_copy(update={"max_new_tokens": limit})
            gens = engine.generate(
                [s.next_prompt or [] for s in batch],
                call_params,
                [s.call_seed() for s in batch],
                return_hidden=on_turn is not None,
            )
            if on_turn is not None:
                on_turn(batch, gens, call_params)
            for state, gen in zip(batch, gens, strict=True):
                state.record(env, tokenizer, gen.output_tokens, gen.logprobs, params.max_new_tokens)


def episode_completions(episode: Episode, policy_version: int, correct: bool) -> list[Completion]:
    """The trainer's completions of ``episode``: one per segment, the segment's context as the
    prompt, everything after it the output with the model tokens marked (the loss sees only
    them); every segment carries the episode's reward, the later ones marked as continuing."""
    if episode.reward is None:
        raise ValueError("score the episode before training on it")
    out = []
    for i, seg in enumerate(episode.segments):
        p = seg.turns[0].end
        out.append(
            Completion(
                prompt_tokens=seg.tokens[:p],
                output_tokens=seg.tokens[p:],
                behaviour_logprobs=list(seg.logprobs),
                reward=episode.reward,
                policy_version=policy_version,
                correct=correct,
                model_mask=[bool(m) for m in seg.model_mask()[p:]],
                continues=i > 0,
            )
        )
    return out


def episode_groups(
    env: MultiTurnEnvironment,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    group_size: int,
    seeds: Sequence[int],
    params: SamplingParams,
    policy_version: int,
) -> list[Group]:
    """``group_size`` scored episodes of each task (seeds task-major), run all at once."""
    flat = [t for t in tasks for _ in range(group_size)]
    states = run_episodes(env, engine, tokenizer, flat, seeds, params)
    return grouped(tasks, [scored_episode(env, s)[:2] for s in states], policy_version)


def grouped(
    tasks: Sequence[Task], scored: Sequence[tuple[Episode, bool]], policy_version: int
) -> list[Group]:
    """The trainer's groups of ``scored`` (episode, correct) pairs, task-major: an equal
    share of them for each task."""
    size = len(scored) // len(tasks)
    groups = []
    for i, task in enumerate(tasks):
        group = Group(task)
        for episode, correct in scored[i * size : (i + 1) * size]:
            group.completions += episode_completions(episode, policy_version, correct)
        groups.append(group)
    return groups


def scored_episode(env: MultiTurnEnvironment, state: EpisodeState) -> tuple[Episode, bool, int]:
    """``(episode with its reward, correct, model turns)``; the reward is the environment's
    score of the transcript."""
    score = env.score_episode(state.task, state.seed, state.transcript)
    correct = bool(score.details.get("correct", score.reward == 1.0))
    return state.episode(score.reward), correct, len(state.calls)


def demonstration_episode(
    env: MultiTurnEnvironment, tokenizer: PreTrainedTokenizerBase, task: Task, flawed: bool
) -> Episode:
    """The warm-start episode of ``task``: the demonstrated model turns (each ended by EOS),
    the environment's replies recomputed between them."""
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    budget = env.token_budget
    state = EpisodeState.start(env, tokenizer, task, 0, budget)
    for text in env.demonstration_turns(task, flawed):
        if state.ended:
            break
        ids = list(tokenizer.encode(text, add_special_tokens=False)) + eos
        ids = ids[: state.next_max]
        state.record(env, tokenizer, ids, [0.0] * len(ids), budget)
    return state.episode(0.0)


def episode_examples(
    env: MultiTurnEnvironment,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    flawed: Sequence[bool],
) -> SFTData:
    """Warm-start rows of demonstration episodes, the loss on model tokens only."""
    rows: list[tuple[list[int], list[int]]] = []
    for task, bad in zip(tasks, flawed, strict=True):
        for seg in demonstration_episode(env, tokenizer, task, bad).segments:
            rows.append((seg.tokens, seg.model_mask()))
    width = max(len(t) for t, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (tokens, model) in enumerate(rows):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens) - 1] = torch.tensor(model[1:], dtype=torch.float32)  # j predicts j+1
    return SFTData(ids, mask)


def warm_start_episodes(
    env: MultiTurnEnvironment,
    tokenizer: PreTrainedTokenizerBase,
    n: int,
    label_noise: float,
    seed: int,
) -> SFTData:
    """The fixed warm-start set: ``n`` training tasks' demonstration episodes, a
    ``label_noise`` share of them flawed (as ``swarmrl.trainer.sft.warm_start_examples``)."""
    rng = random.Random(seed)
    tasks = env.sample("train", n, seed)
    flawed = set(rng.sample(range(n), round(n * label_noise)))
    return episode_examples(env, tokenizer, tasks, [i in flawed for i in range(n)])


def evaluate_episodes(
    env: MultiTurnEnvironment,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    greedy: SamplingParams,
    sampled: SamplingParams,
    samples: int,
    seed: int,
) -> dict[str, float | int]:
    """Greedy accuracy, sampled pass@1 and the greedy episodes' mean model turns (over all,
    and over the solved ones) on ``tasks``."""

    def play(seeds: Sequence[int], params: SamplingParams) -> list[tuple[bool, int]]:
        runs = run_episodes(env, engine, tokenizer, tasks, seeds, params)
        return [scored_episode(env, s)[1:] for s in runs]

    return evaluate_outcomes(play, tasks, greedy, sampled, samples, seed)


def evaluate_outcomes(
    play: Callable[[Sequence[int], SamplingParams], list[tuple[bool, int]]],
    tasks: Sequence[Task],
    greedy: SamplingParams,
    sampled: SamplingParams,
    samples: int,
    seed: int,
) -> dict[str, float | int]:
    """:func:`evaluate_episodes`'s figures, ``play(seeds, params)`` giving each of ``tasks``'
    episodes (episode i from ``seeds[i]``) as (solved, model turns)."""
    runs = play([0] * len(tasks), greedy)
    solved = [turns for ok, turns in runs if ok]
    hits: list[bool] = []
    for k in range(samples):
        hits += [
            ok
            for ok, _ in play([derive_seed("eval", seed, k, t.problem_id) for t in tasks], sampled)
        ]
    return {
        "accuracy": len(solved) / len(tasks),
        "pass_at_1": sum(hits) / max(len(hits), 1),
        "n": len(tasks),
        "mean_turns": sum(turns for _, turns in runs) / len(tasks),
        "mean_turns_solved": sum(solved) / len(solved) if solved else 0.0,
    }
