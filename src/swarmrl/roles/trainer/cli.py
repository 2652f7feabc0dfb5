"""``swarmrl trainer``: the trusted trainer of a swarm. Owns the optimizer, runs the origin.

    swarmrl trainer [CONFIG] --key trainer.key --orchestrator URL --pool ID --run-dir DIR
                    [--origin-host 0.0.0.0] [--origin-port 8470]

The key is the pool owner's: it signs the published versions and the trainer's admin calls.
One step ``n`` (DESIGN.md §2–3):

1. take accepted rollouts from the orchestrator (``/batches``: versions ≥ n − async_level,
   each served once), group them by task (G completions each), recompute every reward with
   the environment (the worker's word is never used), and keep only informative groups
   (online filter); wait, bounded, until ``prompts_per_step`` groups are there;
2. one optimizer step whose importance ratio is taken against the validator's replayed
   log-probs of the behaviour version (the trusted behaviour policy);
3. publish version n + 1 through shardcast (the origin serves it at once) and tell the
   orchestrator, so leases and staleness checks move on.

Surplus informative groups carry over to the next step while still fresh enough. Time spent
waiting for rollouts is the trainer's idle time, reported per step.

Knows nothing about how rollouts were produced or checked beyond the wire types.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.config import SwarmConfig
from swarmrl.envs import Environment, build_env
from swarmrl.errors import WaitTimeout
from swarmrl.identity import KeyPair, load_keypair
from swarmrl.inference.engine import TorchEngine
from swarmrl.model.io import save_policy
from swarmrl.model.prompts import decode_completion
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import TrainableSubmission
from swarmrl.rl import is_informative
from swarmrl.rolekit.supervisor import terminate_as_interrupt
from swarmrl.rolekit.toolkit import (
    StatusReporter,
    add_role_args,
    load_role_config,
    log_config,
    retry,
    setup_logging,
)
from swarmrl.shardcast import Publisher
from swarmrl.shardcast.catalog import Catalog
from swarmrl.shardcast.server import build_app, serve_in_thread
from swarmrl.toploc.thresholds import CalibrationPlan, ensure_thresholds
from swarmrl.trainer.batch import Completion, Group, collate
from swarmrl.trainer.evaluate import evaluate
from swarmrl.trainer.step import make_optimizer, policy_step
from swarmrl.trainer.warmstart import continue_warm_start, ensure_warm_start, load_start_policy


def groups_of(
    sub: TrainableSubmission, env: Environment, tokenizer: PreTrainedTokenizerBase, group_size: int
) -> list[Group]:
    """Split one accepted submission into per-task groups, rewards recomputed from the text.

    Behaviour log-probs are the validator's replay; a submission that was never validated
    has none and is not trained on.
    """
    if sub.behaviour_logprobs is None:
        return []
    out = []
    for j, task_index in enumerate(sub.task_indices):
        task = env.task("train", task_index)
        group = Group(task)
        rows = range(j * group_size, (j + 1) * group_size)
        for sample, behaviour in zip(
            (sub.samples[i] for i in rows), (sub.behaviour_logprobs[i] for i in rows), strict=True
        ):
            text = decode_completion(tokenizer, sample.output_tokens)
            score = env.score(task, text, num_tokens=len(sample.output_tokens))
            group.completions.append(
                Completion(
                    prompt_tokens=list(sample.prompt_tokens),
                    output_tokens=list(sample.output_tokens),
                    behaviour_logprobs=list(behaviour),
                    reward=score.reward,
                    policy_version=sample.policy_version,
                    correct=bool(score.details.get("correct", score.reward == 1.0)),
                    text=text,
                )
            )
        out.append(group)
    return out


def group_version(group: Group) -> int:
    """The oldest policy version among a group's completions."""
    return min(c.policy_version for c in group.completions)


class BatchCollector:
    """Fills step n's batch with informative groups from the orchestrator (see module doc)."""

    def __init__(
        self,
        pool: PoolClient,
        pool_id: str,
        env: Environment,
        tokenizer: PreTrainedTokenizerBase,
        config: SwarmConfig,
        log: logging.Logger,
    ) -> None:
        self.pool = pool
        self.pool_id = pool_id
        self.env = env
        self.tokenizer = tokenizer
        self.config = config
        self.log = log
        self.carry: list[Group] = []
        self.consumed: list[str] = []

    def collect(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """Step ``step``'s informative groups and rollout statistics; raises WaitTimeout when
        starved. Statistics cover every group that arrived (kept or filtered), as colocated."""
        rl, swarm = self.config.rl, self.config.swarm
        need = rl.prompts_per_step
        oldest = step - rl.async_level
        kept = [g for g in self.carry if group_version(g) >= oldest]
        seen: list[Group] = []
        start = time.monotonic()
        next_note = start + 30.0
        while len(kept) < need:
            reply = retry(
                lambda: self.pool.batch(self.pool_id, step, 64),
                f"fetch accepted rollouts for step {step}",
                self.log,
                give_up_s=swarm.give_up_s,
                pause_s=swarm.retry_s,
            )
            for sub in reply.submissions:
                self.consumed.append(sub.submission_id)
                for group in groups_of(sub, self.env, self.tokenizer, rl.group_size):
                    seen.append(group)
                    if not rl.online_filter or is_informative(group.rewards):
                        kept.append(group)
            if len(kept) >= need:
                break
            waited = time.monotonic() - start
            if waited > swarm.batch_timeout_s:
                raise WaitTimeout(
                    f"step {step}: {len(kept)}/{need} informative groups after "
                    f"{waited:.0f} s waiting for accepted rollouts with version ≥ {oldest}"
                )
            if time.monotonic() > next_note:
                self.log.info(
                    "step %d: %d/%d groups; waiting for accepted rollouts", step, len(kept), need
                )
                next_note += 30.0
            time.sleep(0.2)
        self.carry = kept[need:]
        completions = [c for g in seen for c in g.completions] or [
            c for g in kept[:need] for c in g.completions
        ]
        lag = [step - c.policy_version for g in kept[:need] for c in g.completions]
        stats = {
            "reward_mean": sum(c.reward for c in completions) / len(completions),
            "accuracy": sum(c.correct for c in completions) / len(completions),
            "groups_sampled": len(seen),
            "groups_kept": need,
            "tokens": sum(len(c.output_tokens) for c in completions),
            "idle_s": time.monotonic() - start,
            "staleness": sum(lag) / len(lag),
        }
        return kept[:need], stats


class Learner:
    """The policy and its optimizer; one RL step on groups; held-out evaluation.

    Warm start, the step and evaluation are the learning core's (``swarmrl.trainer``), the same
    code the colocated loop runs.
    """

    def __init__(self, config: SwarmConfig, env: Environment, log: logging.Logger) -> None:
        warm = ensure_warm_start(config, env)
        self.warm = warm
        log.info(
            "warm start %s (%s)", warm.path, "cached" if warm.cached else f"{warm.seconds:.0f} s"
        )
        self.config = config
        self.env = env
        self.model, self.tokenizer = load_start_policy(config, warm)
        self.optimizer = make_optimizer(self.model, config.rl)

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy (greedy) and pass@1 of the current policy."""
        c = self.config
        engine = TorchEngine(self.model, self.tokenizer)
        result = evaluate(
            self.env, engine, self.tokenizer, c.eval.n, c.eval.samples, c.rl.sampling, c.run.seed
        )
        return dict(result)

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step; the ratio is against the groups' behaviour log-probs."""
        rl = self.config.rl
        batch = collate(groups, int(self.tokenizer.pad_token_id), rl.advantage)
        stats = policy_step(self.model, self.optimizer, batch, rl, None, rl.micro_batch)
        return {
            "loss": stats.loss,
            "clip_fraction": stats.clip_fraction,
            "grad_norm": stats.grad_norm,
            "entropy": stats.entropy,
            "kl": stats.kl,
        }

    def control(self, seconds: float) -> dict[str, float]:
        """The control arm: the warm start's SFT continued for ``seconds``, then evaluated."""
        c = self.config
        model, tokenizer, steps = continue_warm_start(c, self.env, self.warm, seconds)
        engine = TorchEngine(model, tokenizer)
        result = evaluate(
            self.env, engine, tokenizer, c.eval.n, c.eval.samples, c.rl.sampling, c.run.seed
        )
        return {**result, "sft_steps": steps}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmrl trainer", description=__doc__.splitlines()[0])
    add_role_args(parser)
    parser.add_argument("--orchestrator", required=True, help="orchestrator URL")
    parser.add_argument("--pool", default="swarm", help="pool id (this key must own it)")
    parser.add_argument("--run-dir", required=True, help="where the origin store and report go")
    parser.add_argument("--origin-host", default="127.0.0.1", help="address the origin binds")
    parser.add_argument("--origin-port", type=int, default=8470, help="origin port; 0 = any")
    return parser


class Origin:
    """The publisher and the HTTP origin serving its store."""

    def __init__(
        self, store_dir: Path, keypair: KeyPair, config: SwarmConfig, host: str, port: int
    ) -> None:
        self.store_dir = store_dir
        self.publisher = Publisher(store_dir, keypair, config.shardcast)
        catalog = Catalog(store_dir, config.shardcast.keep_versions)
        catalog.refresh()
        self.server = serve_in_thread(
            build_app(catalog, config.shardcast, role="origin", watch_disk=True), host, port
        )
        self.bytes_full = 0
        self.bytes_delta = 0
        self.versions: list[int] = []

    def publish(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        version: int,
        scratch: Path,
    ) -> None:
        """Save, shard, sign and serve ``version``; the checkpoint copy is removed afterwards."""
        checkpoint = save_policy(model, tokenizer, scratch / f"v{version}")
        manifest = self.publisher.publish(checkpoint, version, version)
        self.bytes_full += manifest.total_bytes
        self.bytes_delta += sum(d.size for d in manifest.deltas)
        self.versions.append(version)
        shutil.rmtree(checkpoint)

    def stop(self) -> None:
        self.server.stop()


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    config = load_role_config(args)
    name = args.name or "trainer"
    log = setup_logging(name)
    log_config(log, config)
    keypair = load_keypair(args.key)
    torch.set_num_threads(config.run.threads)
    status = StatusReporter("trainer", name, args.status_dir, config.swarm.status_interval_s)
    with terminate_as_interrupt(), status:
        try:
            return run(args, config, keypair, log, status)
        except KeyboardInterrupt:
            log.info("stopping")
            return 130


def calibrate_verifier(
    config: SwarmConfig, model_dir: Path, status: StatusReporter, log: logging.Logger
) -> None:
    """Record thresholds calibrated on the starting policy where the validators will read them
    (``toploc.thresholds_path``), before version 0 is published; kept if already there."""
    toploc = config.toploc
    if toploc.thresholds_path is None or not toploc.calibrate_at_start:
        return
    out = Path(toploc.thresholds_path)
    if out.is_file():
        return
    status.set(state="calibrating the verifier")
    s = config.rl.sampling
    plan = CalibrationPlan(
        samples=toploc.calibration_samples,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
    )
    started = time.monotonic()
    document = ensure_thresholds(
        model_dir,
        config.model.dtype,
        out,
        plan=plan,
        cache_dir=config.run.cache_dir,
        topk=toploc.topk,
    )
    log.info(
        "verifier thresholds for %s (%s) in %.1f s: %s -> %s",
        model_dir,
        config.model.dtype,
        time.monotonic() - started,
        json.dumps(document["thresholds"]),
        out,
    )


def run(
    args: argparse.Namespace,
    config: SwarmConfig,
    keypair: KeyPair,
    log: logging.Logger,
    status: StatusReporter,
) -> int:
    run_dir = Path(args.run_dir)
    work = run_dir / "trainer"
    work.mkdir(parents=True, exist_ok=True)
    swarm, rl = config.swarm, config.rl
    env = build_env(config.env)
    status.set(state="warm start")
    learner = Learner(config, env, log)
    calibrate_verifier(config, learner.warm.path, status, log)
    origin = Origin(work / "origin", keypair, config, args.origin_host, args.origin_port)
    log.info("origin serving %s at %s", origin.store_dir, origin.server.url)
    history: list[dict[str, float]] = []
    try:
        with PoolClient(args.orchestrator, keypair, swarm.peer_timeout_s) as pool:

            def announce(version: int) -> None:
                origin.publish(learner.model, learner.tokenizer, version, work)
                retry(
                    lambda: pool.set_version(args.pool, version),
                    f"announce v{version}",
                    log,
                    give_up_s=swarm.give_up_s,
                    pause_s=swarm.retry_s,
                )
                status.set(version=version)

            evals: dict[str, dict[str, float]] = {}
            heldout: list[dict[str, float]] = []
            started: float | None = None

            def evaluate_now(step: int) -> dict[str, float]:
                result = learner.evaluate()
                wall = time.monotonic() - started if started is not None else 0.0
                heldout.append({"step": step, "wall_time": wall, **result})
                log.info("held-out after %d steps: accuracy %.3f", step, result["accuracy"])
                status.set(accuracy=result["accuracy"])
                return result

            status.set(state="evaluating")
            evals["before"] = evaluate_now(0)
            announce(0)
            collector = BatchCollector(pool, args.pool, env, learner.tokenizer, config, log)
            started = time.monotonic()
            idle_total = 0.0
            for step in range(rl.steps):
                status.set(state=f"waiting for step {step} rollouts")
                step_start = time.monotonic()
                groups, rollouts = collector.collect(step)
                idle_total += rollouts["idle_s"]
                status.set(state=f"training step {step}")
                trained = learner.step(groups)
                announce(step + 1)
                elapsed = time.monotonic() - step_start
                row = {
                    "step": step,
                    "policy_version": step,
                    **rollouts,
                    **trained,
                    "tokens_per_s": rollouts["tokens"] / elapsed if elapsed > 0 else 0.0,
                    "wall_time": time.monotonic() - started,
                }
                history.append(row)
                if config.eval.every and (step + 1) % config.eval.every == 0 and step + 1 < rl.steps:
                    evaluate_now(step + 1)
                status.set(
                    step=step + 1,
                    reward_mean=rollouts["reward_mean"],
                    idle_fraction=idle_total / max(time.monotonic() - started, 1e-9),
                )
                log.info("step %d: %s", step, json.dumps({k: round(v, 4) for k, v in row.items()}))
            rl_seconds = time.monotonic() - started
            status.set(state="evaluating")
            evals["after"] = evaluate_now(rl.steps)
            if config.eval.control and config.model.path is None:
                status.set(state="control: SFT continued")
                evals["control"] = learner.control(rl_seconds)
                log.info("control (SFT continued): accuracy %.3f", evals["control"]["accuracy"])
            warm = learner.warm
            summary = {
                "steps": rl.steps,
                "rl_seconds": rl_seconds,
                "idle_s": idle_total,
                "warm_start": {
                    "path": str(warm.path),
                    "cached": warm.cached,
                    "seconds": warm.seconds,
                    "steps": warm.steps,
                },
                "evals": evals,
                "heldout": heldout,
                "versions_published": len(origin.versions),
                "bytes_full": origin.bytes_full,
                "bytes_delta": origin.bytes_delta,
                "consumed_submissions": collector.consumed,
                "history": history,
            }
            (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            status.set(state="done")
    finally:
        origin.stop()
    return 0
