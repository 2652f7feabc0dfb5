"""Episodes of a harness environment (``swarmrl.envs.vf1``: a verifiers 0.4 taskset played by
its harness program), generated and evaluated by an in-process engine.

The engine answers the harness's model calls through a token endpoint on loopback
(``swarmrl.inference.token_endpoint``: call k of an episode samples with
``derive_seed("turn", seed, k)``); the policy's tokenizer is written once to a scratch directory,
where the harness's chat renderer loads it. Each episode's reward is the taskset's own, computed
from the trace in this process: the trainer plays the harness itself, so the trace is its own.
A harness that fails (exits non-zero, runs past its timeout, makes no model call, or returns a
trace that is not what was sampled) is a :class:`~swarmrl.errors.HarnessFailed` naming the
task; the run stops on it rather than training on part of a step.

Untrusted workers play these episodes only where the harness is declared deterministic
(``env.verifiers_reexecute``): the trusted side then plays each of theirs again
(``swarmrl.trainer.harness_check``); otherwise a swarm refuses them
(``swarmrl.envs.multiturn.require_recomputable``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from swarmrl.envs import Task
from swarmrl.envs.vf1 import HarnessEpisode, VerifiersV1Env
from swarmrl.inference.interface import Engine
from swarmrl.inference.token_endpoint import serve_engine
from swarmrl.protocol import SamplingParams
from swarmrl.trainer.batch import Group
from swarmrl.trainer.episodes import evaluate_outcomes, grouped


class HarnessPlayer:
    """Plays ``env``'s episodes with ``engine`` (module docstring); ``close`` removes the
    tokenizer's scratch directory."""

    def __init__(
        self, env: VerifiersV1Env, engine: Engine, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        self.env, self.engine = env, engine
        self._scratch = tempfile.TemporaryDirectory(prefix="swarmrl-harness-")
        self.tokenizer_dir = str(Path(self._scratch.name) / "tokenizer")
        tokenizer.save_pretrained(self.tokenizer_dir)

    def play(
        self, tasks: Sequence[Task], seeds: Sequence[int], params: SamplingParams
    ) -> list[HarnessEpisode]:
        """One episode per task, episode i from ``seeds[i]``, all at once."""
        with serve_engine(self.engine, params) as endpoint:
            return self.env.run_episodes(tasks, seeds, endpoint, self.tokenizer_dir, params)

    def groups(
        self,
        tasks: Sequence[Task],
        group_size: int,
        seeds: Sequence[int],
        params: SamplingParams,
        policy_version: int,
    ) -> list[Group]:
        """``group_size`` scored episodes of each task (seeds task-major)."""
        played = self.play([t for t in tasks for _ in range(group_size)], seeds, params)
        scored = [(r.episode, r.episode.reward == 1.0) for r in played]
        return grouped(tasks, scored, policy_version)

    def evaluate(
        self,
        tasks: Sequence[Task],
        greedy: SamplingParams,
        sampled: SamplingParams,
        samples: int,
        seed: int,
    ) -> dict[str, float | int]:
        """Greedy accuracy, sampled pass@1 and the greedy episodes' mean model turns (over
        all, and over the solved ones) on ``tasks``, as ``evaluate_episodes`` reports them."""

        def play(seeds: Sequence[int], params: SamplingParams) -> list[tuple[bool, int]]:
            played = self.play(tasks, seeds, params)
            return [(r.episode.reward == 1.0, r.episode.model_turns()) for r in played]

        return evaluate_outcomes(play, tasks, greedy, sampled, samples, seed)

    def close(self) -> None:
        self._scratch.cleanup()
