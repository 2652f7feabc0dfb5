"""The in-process rollout source: tasks → G seeded samples each with a local engine → groups.

Every sample's seed is ``derive_seed("rollout", run_seed, step, round, prompt, sample)`` and
each round's tasks are drawn with ``derive_seed("tasks", run_seed, step, round)`` (the one
seeding rule, :mod:`swarmrl.protocol.seeds`), so a run is reproducible and every token can be
replayed from its seed. Rewards are computed on the trusted side from the decoded completion. A multi-turn
environment's groups are G episodes each, all advanced together a turn per engine call
(:func:`swarmrl.trainer.episodes.episode_groups`); sample j of task i is then the episode seed.
With the online filter on, groups whose rewards are all equal are dropped and more tasks are
drawn, up to ``max_backfill_rounds`` extra rounds.

:class:`EngineSource` is the colocated mode's :class:`~swarmrl.trainer.source.RolloutSource`:
it generates with its own engine copy of the policy, so the log-probs it reports are the
behaviour log-probs of the ratio, and after each step it loads the new weights into that
engine. Knows nothing about the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.config.rl import RLConfig, SamplingConfig
from swarmrl.envs import Environment, Task
from swarmrl.envs.multiturn import MultiTurnEnvironment
from swarmrl.envs.vf1 import VerifiersV1Env
from swarmrl.inference.interface import Engine
from swarmrl.model.prompts import encode_prompt
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.seeds import derive_seed
from swarmrl.rl import fill_with_informative
from swarmrl.trainer.batch import Group
from swarmrl.trainer.episodes import episode_groups
from swarmrl.trainer.harness import HarnessPlayer
from swarmrl.trainer.source import Feed, StepRollouts, scored_completion


def sampling_params(sampling: SamplingConfig, tokenizer: PreTrainedTokenizerBase) -> SamplingParams:
    """The section's parameters, with the tokenizer's EOS id as the stop token."""
    stops = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    return SamplingParams.model_validate({**sampling.model_dump(), "stop_token_ids": stops})


class RolloutSampler:
    """Draws training tasks and samples scored groups with ``engine``."""

    def __init__(
        self,
        env: Environment,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        rl: RLConfig,
        seed: int,
    ) -> None:
        self.env, self.engine, self.tokenizer, self.rl, self.seed = env, engine, tokenizer, rl, seed
        self.params = sampling_params(rl.sampling, tokenizer)
        # a verifiers taskset's episodes are played by its harness (swarmrl.trainer.harness)
        self.harness = (
            HarnessPlayer(env, engine, tokenizer) if isinstance(env, VerifiersV1Env) else None
        )

    def close(self) -> None:
        if self.harness is not None:
            self.harness.close()

    def sample_groups(
        self, tasks: Sequence[Task], step: int, round_: int, policy_version: int
    ) -> list[Group]:
        g = self.rl.group_size
        seeds = [
            derive_seed("rollout", self.seed, step, round_, i, j)
            for i in range(len(tasks))
            for j in range(g)
        ]
        if self.harness is not None:
            return self.harness.groups(tasks, g, seeds, self.params, policy_version)
        if isinstance(self.env, MultiTurnEnvironment):
            return episode_groups(
                self.env, self.engine, self.tokenizer, tasks, g, seeds, self.params, policy_version
            )
        prompts = [encode_prompt(self.tokenizer, t) for t in tasks]
        flat_prompts = [p for p in prompts for _ in range(g)]
        generations = self.engine.generate(flat_prompts, self.params, seeds)
        groups = []
        for i, task in enumerate(tasks):
            group = Group(task)
            for gen in generations[i * g : (i + 1) * g]:
                group.completions.append(
                    scored_completion(
                        self.env,
                        self.tokenizer,
                        task,
                        gen.prompt_tokens,
                        gen.output_tokens,
                        gen.logprobs,
                        policy_version,
                    )
                )
            groups.append(group)
        return groups

    def batch(self, step: int, policy_version: int) -> StepRollouts:
        """The groups to train on at ``step`` (informative only when the filter is on)."""
        seen: list[Group] = []

        def sample(n: int, round_: int) -> list[Group]:
            tasks = self.env.sample("train", n, derive_seed("tasks", self.seed, step, round_))
            groups = self.sample_groups(tasks, step, round_, policy_version)
            seen.extend(groups)
            return groups

        need = self.rl.prompts_per_step
        if self.rl.online_filter:
            kept, _ = fill_with_informative(sample, need, self.rl.max_backfill_rounds)
        else:
            kept = sample(need, 0)
        return StepRollouts(groups=kept, seen=seen)


class EngineSource:
    """Rollouts from an in-process engine that follows ``policy`` (module docstring)."""

    def __init__(
        self,
        sampler: RolloutSampler,
        policy: PreTrainedModel,
    ) -> None:
        self.sampler, self.policy = sampler, policy
        self.loaded_version = 0  # the policy version the engine's weights are

    def next_batch(self, step: int, policy_version: int, early: Feed | None = None) -> StepRollouts:
        return self.sampler.batch(step, policy_version)  # generated whole: nothing to feed early

    def commit(self, step: int, policy_version: int) -> None:
        if policy_version != self.loaded_version:
            self.sampler.engine.load_state_dict(self.policy.state_dict())
            self.loaded_version = policy_version
