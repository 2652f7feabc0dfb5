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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmrl.config import SwarmConfig
from swarmrl.envs import Environment, build_env
from swarmrl.errors import ConfigError, WaitTimeout
from swarmrl.identity import KeyPair, load_keypair
from swarmrl.launch.rolekit import (
    StatusReporter,
    add_role_args,
    load_role_config,
    retry,
    setup_logging,
)
from swarmrl.launch.supervisor import terminate_as_interrupt
from swarmrl.protocol.pool import TrainableSubmission


@dataclass
class Group:
    """G completions of one training task, with trusted rewards and behaviour log-probs."""

    task_index: int
    prompt_tokens: list[int]
    outputs: list[list[int]]  # [G][T_i]
    rewards: list[float]  # [G], recomputed here
    behaviour_logprobs: list[list[float]]  # [G][T_i], the validator's replay
    version: int  # oldest policy version among the completions


def groups_of(
    sub: TrainableSubmission, env: Environment, tokenizer, group_size: int
) -> list[Group]:  # type: ignore[no-untyped-def]
    """Split one accepted submission into per-task groups, rewards recomputed from text."""
    if sub.behaviour_logprobs is None:
        return []  # never validated: the trusted side has no behaviour log-probs to use
    out = []
    for j, task_index in enumerate(sub.task_indices):
        samples = sub.samples[j * group_size : (j + 1) * group_size]
        behaviour = sub.behaviour_logprobs[j * group_size : (j + 1) * group_size]
        task = env.task("train", task_index)
        rewards = [
            env.score(
                task,
                tokenizer.decode(s.output_tokens, skip_special_tokens=True),
                len(s.output_tokens),
            ).reward
            for s in samples
        ]
        out.append(
            Group(
                task_index=task_index,
                prompt_tokens=list(samples[0].prompt_tokens),
                outputs=[list(s.output_tokens) for s in samples],
                rewards=rewards,
                behaviour_logprobs=[list(b) for b in behaviour],
                version=min(s.policy_version for s in samples),
            )
        )
    return out


class BatchCollector:
    """Fills step n's batch with informative groups from the orchestrator (see module doc)."""

    def __init__(
        self,
        pool,
        pool_id: str,
        env: Environment,
        tokenizer,
        config: SwarmConfig,
        log: logging.Logger,
    ) -> None:  # type: ignore[no-untyped-def]
        self.pool = pool
        self.pool_id = pool_id
        self.env = env
        self.tokenizer = tokenizer
        self.config = config
        self.log = log
        self.carry: list[Group] = []
        self.groups_seen = 0
        self.groups_dropped = 0

    def collect(self, step: int) -> tuple[list[Group], float]:
        """``(groups, seconds waited)`` for step ``step``; raises WaitTimeout when starved."""
        rl, swarm = self.config.rl, self.config.swarm
        need = rl.prompts_per_step
        oldest = step - rl.async_level
        kept = [g for g in self.carry if g.version >= oldest]
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
                for group in groups_of(sub, self.env, self.tokenizer, rl.group_size):
                    self.groups_seen += 1
                    if rl.online_filter and max(group.rewards) == min(group.rewards):
                        self.groups_dropped += 1
                        continue
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
        return kept[:need], time.monotonic() - start


def warm_start(config: SwarmConfig, env: Environment, log: logging.Logger):  # type: ignore[no-untyped-def]
    """The starting policy: ``model.path`` if given, else the tiny model after the SFT warm
    start, cached under ``run.cache_dir`` by a digest of everything that shapes it."""
    from swarmrl.identity import canonical_json, digest_hex
    from swarmrl.model import build_char_tokenizer, create_tiny_model, load_policy, save_policy
    from swarmrl.trainer.sft import SFTTrainer, warm_start_examples

    if config.model.path is not None:
        return load_policy(config.model.path, dtype=config.model.dtype)
    shape = {k: config.model_dump(mode="json")[k] for k in ("model", "env", "sft")}
    shape["seed"] = config.run.seed
    cached = Path(config.run.cache_dir) / "warmstart" / digest_hex(canonical_json(shape))[:16]
    if (cached / "config.json").is_file():
        log.info("warm start: cached policy %s", cached)
        return load_policy(str(cached))
    if env.alphabet is None:
        raise ConfigError(f"env {env.name!r} needs model.path (no built-in tokenizer)")
    log.info("warm start: %d SFT steps (cached afterwards in %s)", config.sft.steps, cached)
    torch.manual_seed(config.run.seed)
    tokenizer = build_char_tokenizer(env.alphabet)
    model = create_tiny_model(config.model.tiny, tokenizer)
    sft = config.sft
    data = warm_start_examples(env, tokenizer, sft.train_examples, sft.label_noise, config.run.seed)
    SFTTrainer(model, data, sft.batch_size, sft.lr, config.run.seed).run(steps=sft.steps)
    model.eval()
    save_policy(model, tokenizer, cached)
    return model, tokenizer


class Learner:
    """The policy, its optimizer, one RL step on groups, and held-out evaluation."""

    def __init__(self, config: SwarmConfig, env: Environment, log: logging.Logger) -> None:
        from swarmrl.trainer.sft import greedy_exact_match

        self.config = config
        self.env = env
        self.model, self.tokenizer = warm_start(config, env, log)
        rl = config.rl
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=rl.lr, weight_decay=rl.weight_decay
        )
        self.heldout = env.first("heldout", config.eval.n)
        self._accuracy = greedy_exact_match

    def evaluate(self) -> float:
        """Greedy exact-match accuracy on the fixed held-out set."""
        self.model.eval()
        return self._accuracy(self.model, self.tokenizer, self.heldout)

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on ``groups``; the ratio is against the behaviour log-probs."""
        from swarmrl.rl.advantages import group_advantages
        from swarmrl.rl.logprobs import token_logprobs
        from swarmrl.rl.loss import clip_fraction, clipped_token_loss, importance_ratio, token_mean
        from swarmrl.rl.metrics import clip_grad_norm

        rl = self.config.rl
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [N, G]
        advantages = group_advantages(rewards, rl.advantage).flatten()  # [N·G]
        rows = [
            (g.prompt_tokens, out, b)
            for g in groups
            for out, b in zip(g.outputs, g.behaviour_logprobs, strict=True)
        ]
        width = max(len(p) + len(o) for p, o, _ in rows)
        pad = int(self.tokenizer.pad_token_id)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(rows), width - 1))  # [B, T-1]: 1 where position predicts output
        behaviour = torch.zeros((len(rows), width - 1))  # [B, T-1]
        for b, (prompt, out, blp) in enumerate(rows):
            ids[b, : len(prompt) + len(out)] = torch.tensor(prompt + out)
            start = len(prompt) - 1
            mask[b, start : start + len(out)] = 1.0
            behaviour[b, start : start + len(out)] = torch.tensor(blp)
        self.model.train()
        logp, entropy = token_logprobs(
            self.model,
            ids,
            chunk=rl.logprob_chunk,
            temperature=rl.sampling.temperature,
            with_entropy=True,
        )  # [B, T-1]
        ratio = importance_ratio(logp, behaviour, rl.max_log_ratio)
        token_loss, clipped = clipped_token_loss(
            ratio, advantages[:, None], rl.eps_low, rl.eps_high, rl.delta
        )
        loss = token_mean(token_loss, mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = clip_grad_norm(self.model.parameters(), rl.grad_clip)
        self.optimizer.step()
        self.model.eval()
        return {
            "loss": float(loss),
            "reward_mean": float(rewards.mean()),
            "grad_norm": float(grad_norm),
            "clip_fraction": clip_fraction(clipped, mask),
            "entropy": float(token_mean(entropy, mask)) if entropy is not None else 0.0,
            "ratio_mean": float(token_mean(ratio.detach(), mask)),
        }


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
        from swarmrl.shardcast import Publisher
        from swarmrl.shardcast.catalog import Catalog
        from swarmrl.shardcast.server import build_app, serve_in_thread

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

    def publish(self, model, tokenizer, version: int, scratch: Path) -> None:  # type: ignore[no-untyped-def]
        from swarmrl.model.io import save_policy

        checkpoint = save_policy(model, tokenizer, scratch / f"v{version}")
        manifest = self.publisher.publish(checkpoint, version, version)
        self.bytes_full += manifest.total_bytes
        self.bytes_delta += sum(d.size for d in manifest.deltas)
        self.versions.append(version)
        for path in sorted(Path(checkpoint).iterdir()):
            path.unlink()
        Path(checkpoint).rmdir()

    def stop(self) -> None:
        self.server.stop()


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    config = load_role_config(args)
    name = args.name or "trainer"
    log = setup_logging(name)
    keypair = load_keypair(args.key)
    torch.set_num_threads(config.run.threads)
    status = StatusReporter("trainer", name, args.status_dir, config.swarm.status_interval_s)
    with terminate_as_interrupt(), status:
        try:
            return run(args, config, keypair, log, status)
        except KeyboardInterrupt:
            log.info("stopping")
            return 130


def run(
    args: argparse.Namespace,
    config: SwarmConfig,
    keypair: KeyPair,
    log: logging.Logger,
    status: StatusReporter,
) -> int:
    from swarmrl.pool.client import PoolClient

    run_dir = Path(args.run_dir)
    work = run_dir / "trainer"
    work.mkdir(parents=True, exist_ok=True)
    swarm, rl = config.swarm, config.rl
    env = build_env(config.env)
    status.set(state="warm start")
    learner = Learner(config, env, log)
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

            accuracy = learner.evaluate()
            log.info("held-out accuracy before RL: %.3f", accuracy)
            history.append({"step": 0, "accuracy": accuracy})
            announce(0)
            collector = BatchCollector(pool, args.pool, env, learner.tokenizer, config, log)
            started = time.monotonic()
            idle_total = 0.0
            for step in range(rl.steps):
                status.set(state=f"waiting for step {step} rollouts")
                groups, idle_s = collector.collect(step)
                idle_total += idle_s
                status.set(state=f"training step {step}")
                metrics = learner.step(groups)
                announce(step + 1)
                row = {
                    "step": step + 1,
                    "idle_s": idle_s,
                    **metrics,
                    "versions_in_batch": float(sum(step - g.version for g in groups)) / len(groups),
                }
                if (step + 1) % swarm.eval_every == 0 or step + 1 == rl.steps:
                    row["accuracy"] = learner.evaluate()
                history.append(row)
                elapsed = time.monotonic() - started
                status.set(
                    step=step + 1,
                    reward_mean=metrics.get("reward_mean", 0.0),
                    idle_fraction=idle_total / max(elapsed, 1e-9),
                    **({"accuracy": row["accuracy"]} if "accuracy" in row else {}),
                )
                log.info(
                    "step %d: %s", step + 1, json.dumps({k: round(v, 4) for k, v in row.items()})
                )
            summary = {
                "steps": rl.steps,
                "wall_s": time.monotonic() - started,
                "idle_s": idle_total,
                "versions_published": len(origin.versions),
                "bytes_full": origin.bytes_full,
                "bytes_delta": origin.bytes_delta,
                "groups_seen": collector.groups_seen,
                "groups_dropped": collector.groups_dropped,
                "history": history,
            }
            (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            status.set(state="done")
    finally:
        origin.stop()
    return 0
