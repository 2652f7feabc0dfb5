"""Colocated rollout generation: tasks → G seeded samples each → scored groups.

Every sample's seed is ``derive_seed("rollout", run_seed, step, round, prompt, sample)``, so a run is
reproducible and every token can be replayed from its seed. Rewards are computed here, on the
trusted side, from the decoded completion. With the online filter on, groups whose rewards are
all equal are dropped and more tasks are drawn, up to ``max_backfill_rounds`` extra rounds.

Knows nothing about the optimizer; the engine it is given generates with the current policy,
so the log-probs it reports are the behaviour log-probs of the ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from swarmrl.config.rl import RLConfig, SamplingConfig
from swarmrl.envs import Environment, Task
from swarmrl.inference.engine import TorchEngine
from swarmrl.model.prompts import decode_completion, encode_prompt
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.seeds import derive_seed
from swarmrl.rl import fill_with_informative
from swarmrl.trainer.batch import Completion, Group


def sampling_params(sampling: SamplingConfig, tokenizer: PreTrainedTokenizerBase) -> SamplingParams:
    """The section's parameters, with the tokenizer's EOS id as the stop token."""
    stops = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    return SamplingParams.model_validate({**sampling.model_dump(), "stop_token_ids": stops})


@dataclass
class RolloutStats:
    groups_sampled: int
    groups_kept: int
    reward_mean: float  # over every sampled completion, kept or not
    accuracy: float  # share of sampled completions that are correct
    tokens: int  # output tokens generated


class RolloutSampler:
    """Draws training tasks and samples scored groups with ``engine``."""

    def __init__(
        self,
        env: Environment,
        engine: TorchEngine,
        tokenizer: PreTrainedTokenizerBase,
        rl: RLConfig,
        seed: int,
    ) -> None:
        self.env, self.engine, self.tokenizer, self.rl, self.seed = env, engine, tokenizer, rl, seed
        self.params = sampling_params(rl.sampling, tokenizer)

    def sample_groups(
        self, tasks: Sequence[Task], step: int, round_: int, policy_version: int
    ) -> list[Group]:
        g = self.rl.group_size
        prompts = [encode_prompt(self.tokenizer, t) for t in tasks]
        flat_prompts = [p for p in prompts for _ in range(g)]
        seeds = [
            derive_seed("rollout", self.seed, step, round_, i, j)
            for i in range(len(tasks))
            for j in range(g)
        ]
        generations = self.engine.generate(flat_prompts, self.params, seeds)
        groups = []
        for i, task in enumerate(tasks):
            group = Group(task)
            for gen in generations[i * g : (i + 1) * g]:
                text = decode_completion(self.tokenizer, gen.output_tokens)
                score = self.env.score(task, text, num_tokens=len(gen.output_tokens))
                group.completions.append(
                    Completion(
                        prompt_tokens=list(gen.prompt_tokens),
                        output_tokens=list(gen.output_tokens),
                        behaviour_logprobs=list(gen.logprobs),
                        reward=score.reward,
                        policy_version=policy_version,
                        correct=bool(score.details.get("correct", score.reward == 1.0)),
                        text=text,
                    )
                )
            groups.append(group)
        return groups

    def batch(self, step: int, policy_version: int) -> tuple[list[Group], RolloutStats]:
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
        completions = [c for g in seen for c in g.completions]
        stats = RolloutStats(
            groups_sampled=len(seen),
            groups_kept=len(kept),
            reward_mean=sum(c.reward for c in completions) / max(len(completions), 1),
            accuracy=sum(c.correct for c in completions) / max(len(completions), 1),
            tokens=sum(len(c.output_tokens) for c in completions),
        )
        return kept, stats
