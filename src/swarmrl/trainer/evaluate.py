"""Held-out evaluation: greedy accuracy and sampled pass@1 on the first n held-out tasks.

    accuracy  = share of tasks whose greedy completion is correct
    pass_at_1 = mean over tasks and k samples (rollout temperature) of correctness

"Correct" is the environment's ``correct`` detail (an exact answer), or reward = 1 where an
environment reports none. A held-out split smaller than n is evaluated whole, with one warning
naming both numbers. Knows nothing about training.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from swarmrl.config.rl import SamplingConfig
from swarmrl.envs import Environment, Task
from swarmrl.envs.multiturn import MultiTurnEnvironment
from swarmrl.envs.vf1 import VerifiersV1Env
from swarmrl.inference.interface import Engine
from swarmrl.model.prompts import decode_completion, encode_prompt
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.seeds import derive_seed
from swarmrl.trainer.episodes import evaluate_episodes
from swarmrl.trainer.harness import HarnessPlayer
from swarmrl.trainer.rollout import sampling_params

EVAL_BATCH = 512  # prompts per engine call
log = logging.getLogger(__name__)
_warned: set[tuple[str, int, int]] = set()  # (env, n, held-out size) already warned about


def _warn_short_heldout(env: Environment, n: int, size: int) -> None:
    """Say once per process that ``eval.n`` asks for more than the held-out split holds."""
    if (env.name, n, size) in _warned:
        return
    _warned.add((env.name, n, size))
    log.warning(
        "eval.n = %d but the held-out split of env %r has %d problems (env.heldout_fraction = "
        "%s): evaluating on %d; lower eval.n or raise env.heldout_fraction",
        n, env.name, size, getattr(env, "heldout_fraction", "?"), size,
    )  # fmt: skip


def correctness(
    env: Environment,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    params: SamplingParams,
    seeds: Sequence[int],
) -> list[bool]:
    """Whether each task's one completion (under ``params`` and its seed) is correct."""
    out: list[bool] = []
    for start in range(0, len(tasks), EVAL_BATCH):
        chunk = tasks[start : start + EVAL_BATCH]
        prompts = [encode_prompt(tokenizer, t) for t in chunk]
        gens = engine.generate(prompts, params, seeds[start : start + EVAL_BATCH])
        for task, gen in zip(chunk, gens, strict=True):
            score = env.score(
                task,
                decode_completion(tokenizer, gen.output_tokens),
                num_tokens=len(gen.output_tokens),
            )
            out.append(bool(score.details.get("correct", score.reward == 1.0)))
    return out


def evaluate(
    env: Environment,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    n: int,
    samples: int,
    sampling: SamplingConfig,
    seed: int,
) -> dict[str, float | int]:
    """``{"accuracy", "pass_at_1", "n"}`` on the first ``n`` held-out tasks (a multi-turn
    environment's: whole episodes, with their mean turns besides)."""
    tasks = env.first("heldout", n)
    if len(tasks) < n:
        _warn_short_heldout(env, n, len(tasks))
    base = sampling_params(sampling, tokenizer)
    greedy = SamplingParams(
        temperature=0.0, max_new_tokens=base.max_new_tokens, stop_token_ids=base.stop_token_ids
    )
    if isinstance(env, VerifiersV1Env):
        player = HarnessPlayer(env, engine, tokenizer)
        try:
            return player.evaluate(tasks, greedy, base, samples, seed)
        finally:
            player.close()
    if isinstance(env, MultiTurnEnvironment):
        return evaluate_episodes(env, engine, tokenizer, tasks, greedy, base, samples, seed)
    hits = correctness(env, engine, tokenizer, tasks, greedy, [0] * len(tasks))
    sampled: list[bool] = []
    for k in range(samples):
        seeds = [derive_seed("eval", seed, k, t.problem_id) for t in tasks]
        sampled += correctness(env, engine, tokenizer, tasks, base, seeds)
    return {
        "accuracy": sum(hits) / len(tasks),
        "pass_at_1": sum(sampled) / max(len(sampled), 1),
        "n": len(tasks),
    }
