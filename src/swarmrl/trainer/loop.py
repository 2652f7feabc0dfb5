"""The one training loop of every mode, over a rollout source::

    eval before → for each step n:
        rollouts = source.next_batch(n, v, early) (v = policy version = optimizer steps so far;
                                                   early: the step's first groups, whose
                                                   gradients are computed while it waits)
        one optimizer step on rollouts.groups     (skipped when the batch came back empty)
        source.commit(n, v')                      (the source hands version v' on)
        one metrics row; a held-out eval every ``eval.every`` steps
    → eval after → control (the warm start's SFT continued for the RL time) → eval

The colocated run and the swarm trainer both run :func:`train`; only the source differs
(:mod:`swarmrl.trainer.source`). Every step's row has the same keys in both modes
(:data:`ROW_KEYS`); ``rl_seconds`` is the loop's wall time without the held-out evaluations
made during it. A row's ``rollout_s`` is the time its step waited for rollouts with nothing
to compute; the gradients computed early count in ``update_s``. The control arm gets
``rl_seconds``, less every ``rollout_s`` when the source's rollouts are made elsewhere
(``train(..., control_without_waits=True)``: the swarm trainer, whose waits for the pool are
time the control, running in the trainer alone, has no use for); ``control_seconds`` says
what it got.

Knows nothing about files, displays or the network: rows and evals go to :class:`Hooks`, and
the caller records the returned :class:`TrainingResult`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmrl.config import SwarmConfig
    from swarmrl.trainer.learner import Learner
    from swarmrl.trainer.source import RolloutSource, StepRollouts
    from swarmrl.trainer.step import StepStats

ROW_KEYS = (
    "step",  # 0-based step index
    "policy_version",  # version being trained at this step (optimizer steps before it)
    "reward_mean",  # mean reward over every completion drawn for the step, kept or not
    "accuracy",  # share of those completions that are correct
    "groups_sampled",  # groups drawn for the step (before the online filter)
    "groups_kept",  # groups trained on
    "tokens",  # sampled output tokens of the drawn completions (environment tokens excluded)
    "staleness",  # mean over trained completions of policy_version − generating version
    "staleness_max",  # the largest of those ages (0 when nothing was trained)
    "staleness_shares",  # {"age": share of trained completions of that age}, ages as strings
    "loss",  # None when the step had nothing to train on
    "clip_fraction",
    "grad_norm",
    "entropy",
    "kl",
    "mismatch_kl",  # mean k3 estimate of KL(behaviour ‖ trainer) over loss tokens
    "corrected_fraction",  # share of loss tokens the off-policy correction truncated or masked
    "rollout_s",  # s spent getting the batch: generating it, or waiting for the pool
    "update_s",  # s of the optimizer step plus handing the new version to the source
    "tokens_per_s",  # tokens / (rollout_s + update_s)
    "wall_time",  # s since the first step began
)
# the row's numbers a trainer role also reports in its status and Prometheus (when not None)
STATUS_KEYS = (
    "loss",
    "kl",
    "clip_fraction",
    "mismatch_kl",
    "corrected_fraction",
    "staleness",
    "staleness_max",
)
_STEP_STATS = (
    "loss",
    "clip_fraction",
    "grad_norm",
    "entropy",
    "kl",
    "mismatch_kl",
    "corrected_fraction",
)


@dataclass
class Hooks:
    """What the caller wants to hear about while the loop proceeds (all optional)."""

    on_phase: Callable[[str], None] = lambda phase: None
    on_step: Callable[[dict[str, Any]], None] = lambda row: None
    on_eval: Callable[[str, dict[str, Any]], None] = lambda name, result: None
    # the result the loop fills in as it goes, handed over before the first eval, so a caller
    # interrupted mid-run can still record everything already finished
    on_start: Callable[[TrainingResult], None] = lambda result: None
    # RL is over and the after-RL eval done (before the control): the policy is final
    on_rl_end: Callable[[Learner], None] = lambda learner: None


@dataclass
class TrainingResult:
    """Everything a run's report says about training; the same in every mode."""

    steps: int = 0  # steps finished (rl.steps once the loop is through)
    rl_seconds: float = 0.0
    warm_start: dict[str, Any] = field(default_factory=dict)  # path, cached, seconds, steps
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)  # before, after[, control]
    during: list[dict[str, Any]] = field(default_factory=list)  # {step, wall_time, **eval}
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per step
    control_seconds: float | None = None  # the control arm's time budget, once it begins

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingResult:
        return cls(**data)


def train(
    config: SwarmConfig,
    learner: Learner,
    source: RolloutSource,
    hooks: Hooks | None = None,
    control_without_waits: bool = False,
) -> TrainingResult:
    """Run ``rl.steps`` steps of ``learner`` on ``source``'s rollouts (module docstring);
    ``control_without_waits``: the control's budget leaves out the steps' ``rollout_s``."""
    hooks = hooks or Hooks()
    warm = learner.warm
    result = TrainingResult(
        warm_start={
            "path": str(warm.path),
            "cached": warm.cached,
            "seconds": warm.seconds,
            "steps": warm.steps,
        }
    )
    hooks.on_start(result)
    _evaluate(learner, hooks, "before", result.evals.__setitem__)
    hooks.on_phase("rl")
    start, eval_seconds, every = time.monotonic(), 0.0, config.eval.every
    for step in range(learner.first_step, config.rl.steps):  # first_step > 0: resumed
        row = train_step(learner, source, step, start)
        result.history.append(row)
        result.steps, result.rl_seconds = step + 1, row["wall_time"] - eval_seconds
        hooks.on_step(row)
        if every and (step + 1) % every == 0 and step + 1 < config.rl.steps:
            eval_start = time.monotonic()
            at = {"step": step + 1, "wall_time": row["wall_time"]}
            _evaluate(
                learner,
                hooks,
                f"after {step + 1} steps",
                lambda name, held, at=at: result.during.append({**at, **held}),
            )
            eval_seconds += time.monotonic() - eval_start
            hooks.on_phase("rl")
    result.steps = config.rl.steps
    result.rl_seconds = time.monotonic() - start - eval_seconds
    _evaluate(learner, hooks, "after", result.evals.__setitem__)
    hooks.on_rl_end(learner)
    if config.eval.control and (config.model.path is None or config.model.warm_start):
        waited = sum(row["rollout_s"] for row in result.history) if control_without_waits else 0
        result.control_seconds = max(result.rl_seconds - waited, 0.0)
        hooks.on_phase("control")
        control = learner.control(result.control_seconds)
        result.evals["control"] = control | (
            {"budget_s": result.control_seconds} if control else {}
        )
        hooks.on_eval("control", result.evals["control"])  # recorded before the hook hears
    return result


def train_step(learner: Learner, source: RolloutSource, step: int, start: float) -> dict[str, Any]:
    """One step: take the batch, train on it, commit; returns the step's metrics row."""
    version = learner.version
    began = time.monotonic()
    early = learner.begin_step()  # fed the batch's first groups while the rest is awaited
    feed = early.feed if early is not None else None
    rollouts = source.next_batch(step, version, feed)  # the one place a step's batch is taken
    taken = time.monotonic()
    computing = early.busy_s if early is not None else 0.0  # in next_batch, not waiting
    stats = learner.step(rollouts.groups, early) if rollouts.groups else None
    source.commit(step, learner.version)  # ... and the one place it is committed
    done = time.monotonic()
    row: dict[str, Any] = {"step": step, "policy_version": version}
    row |= rollout_metrics(rollouts, version)
    row |= step_metrics(stats)
    row |= {
        "rollout_s": taken - began - computing,
        "update_s": done - taken + computing,
        "tokens_per_s": row["tokens"] / (done - began) if done > began else 0.0,
        "wall_time": done - start,
    }
    return row


def rollout_metrics(rollouts: StepRollouts, policy_version: int) -> dict[str, Any]:
    """Reward, accuracy, group counts, tokens and the staleness (age in versions) of one
    step's trained completions: mean, max and the share of each age."""
    # one per group member: an episode's later segments are not completions of their own
    drawn = [c for g in rollouts.seen or rollouts.groups for c in g.completions if not c.continues]
    trained = [c for g in rollouts.groups for c in g.completions if not c.continues]
    n = max(len(drawn), 1)
    ages = [policy_version - c.policy_version for c in trained]
    return {
        "reward_mean": sum(c.reward for c in drawn) / n,
        "accuracy": sum(c.correct for c in drawn) / n,
        "groups_sampled": len(rollouts.seen or rollouts.groups),
        "groups_kept": len(rollouts.groups),
        "tokens": sum(
            c.sampled_tokens for g in rollouts.seen or rollouts.groups for c in g.completions
        ),
        "staleness": sum(ages) / len(ages) if ages else 0.0,
        "staleness_max": max(ages, default=0),
        "staleness_shares": {str(a): ages.count(a) / len(ages) for a in sorted(set(ages))},
    }


def step_metrics(stats: StepStats | None) -> dict[str, float | None]:
    """The optimizer step's numbers (all None when there was nothing to train on)."""
    return {key: None if stats is None else getattr(stats, key) for key in _STEP_STATS}


def _evaluate(
    learner: Learner, hooks: Hooks, name: str, record: Callable[[str, dict[str, Any]], None]
) -> None:
    """Evaluate; ``record`` puts the result into the loop's result before the hook hears of
    it, so a caller writing the result on ``on_eval`` writes it with this evaluation in."""
    hooks.on_phase(f"eval {name}")
    result = learner.evaluate()
    record(name, result)
    hooks.on_eval(name, result)
