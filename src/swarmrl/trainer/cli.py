"""``swarmrl sft``, ``swarmrl eval`` and ``swarmrl filter``.

    swarmrl sft [CONFIG] [--set k=v]                 make (or find) the cached warm start
    swarmrl eval [CONFIG] [--model DIR] [--set k=v]  held-out greedy accuracy and pass@1 (JSON)
    swarmrl filter [CONFIG] --model DIR --out FILE [--lo 0.1 --hi 0.8 --samples 8 --n 1000]
                                                     keep training tasks with pass rate in [lo, hi]

Without ``--model``, ``eval`` uses ``model.path`` or the warm start of the config. ``filter``
works on every environment and writes one JSONL row per kept training task: the task's dataset
row for dataset-backed environments (``math``, ``code``: the file is a dataset they read as is),
else ``{"problem", "answer"}``, plus ``problem_id`` and ``pass_rate``. Any environment trains on
the kept tasks alone with ``env.train_subset = FILE``. Knows nothing about RL steps.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmrl.config import EMBEDDED_DEFAULT, SwarmConfig, load_config
from swarmrl.config.args import add_config_args
from swarmrl.errors import ConfigError

if TYPE_CHECKING:
    from swarmrl.envs import Environment, Task


VERB_HELP = {
    "sft": "warm-start a model by supervised fine-tuning",
    "eval": "held-out accuracy and pass@1 of a model on a task",
    "filter": "keep the training tasks whose pass rate lies in [lo, hi]",
}


def _parser(verb: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"swarmrl {verb}", description=VERB_HELP[verb])
    add_config_args(parser)
    if verb in ("eval", "filter"):
        parser.add_argument("--model", help="HF model directory (default: the config's policy)")
    if verb == "filter":
        parser.add_argument("--out", required=True, help="JSONL file of the kept tasks")
        parser.add_argument("--lo", type=float, default=0.1, help="lowest pass rate kept")
        parser.add_argument("--hi", type=float, default=0.8, help="highest pass rate kept")
        parser.add_argument("--samples", type=int, default=8, help="samples per task")
        parser.add_argument("--n", type=int, default=1000, help="training tasks examined")
    return parser


def _config(args: argparse.Namespace) -> SwarmConfig:
    overrides = list(args.overrides)
    if getattr(args, "model", None):
        overrides.append(f"model.path={json.dumps(args.model)}")
    return load_config([args.config or EMBEDDED_DEFAULT], overrides)


def _policy(config: SwarmConfig):  # type: ignore[no-untyped-def]
    import torch

    from swarmrl.envs import build_env
    from swarmrl.trainer.learner import resolve_device
    from swarmrl.trainer.warmstart import ensure_warm_start, load_start_policy

    torch.set_num_threads(config.run.threads)
    env = build_env(config.env)
    warm = ensure_warm_start(config, env)
    device = resolve_device(config.run.device)
    model, tokenizer = load_start_policy(config, warm, device)
    return env, warm, model, tokenizer, device


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def sft_main(args: argparse.Namespace) -> int:
    from swarmrl.envs import build_env
    from swarmrl.trainer.warmstart import ensure_warm_start

    config = _config(args)
    import torch

    torch.set_num_threads(config.run.threads)
    warm = ensure_warm_start(
        config,
        build_env(config.env),
        on_step=lambda s, loss: print(f"step {s} loss {loss:.4f}") if s % 50 == 0 else None,
    )
    state = "cached" if warm.cached else f"trained {warm.steps} steps in {warm.seconds:.1f} s"
    print(f"warm start ({state}): {warm.path}")
    return 0


def eval_main(args: argparse.Namespace) -> int:
    from swarmrl.trainer.engines import policy_engine
    from swarmrl.trainer.evaluate import evaluate

    config = _config(args)
    env, warm, model, tokenizer, device = _policy(config)
    engine = policy_engine(config, model, tokenizer, device)
    try:
        result = evaluate(
            env,
            engine,
            tokenizer,
            config.eval.n,
            config.eval.samples,
            config.rl.sampling,
            config.run.seed,
        )
    finally:
        engine.close()
    print(json.dumps({"model": str(warm.path), **result}))
    return 0


def filter_main(args: argparse.Namespace) -> int:
    import torch

    from swarmrl.protocol.seeds import derive_seed
    from swarmrl.rl import pass_rate_mask
    from swarmrl.trainer.engines import policy_engine
    from swarmrl.trainer.evaluate import correctness
    from swarmrl.trainer.rollout import sampling_params

    if not 0.0 <= args.lo <= args.hi <= 1.0:
        raise ConfigError(f"need 0 <= --lo <= --hi <= 1, got {args.lo} and {args.hi}")
    if args.samples < 1 or args.n < 1:
        raise ConfigError("--samples and --n must be at least 1")
    config = _config(args)
    env, _, model, tokenizer, device = _policy(config)
    engine = policy_engine(config, model, tokenizer, device)
    tasks = env.first("train", args.n)
    params = sampling_params(config.rl.sampling, tokenizer)
    hits = torch.zeros(len(tasks))
    try:
        for k in range(args.samples):
            seeds = [derive_seed("filter", config.run.seed, k, t.problem_id) for t in tasks]
            hits += torch.tensor(
                correctness(env, engine, tokenizer, tasks, params, seeds), dtype=torch.float32
            )
    finally:
        engine.close()
    rates = hits / args.samples
    keep = pass_rate_mask(rates, args.lo, args.hi)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for task, rate, kept in zip(tasks, rates.tolist(), keep.tolist(), strict=True):
            if kept:
                f.write(json.dumps(kept_row(env, task, rate), default=str) + "\n")
    print(
        f"kept {int(keep.sum())} of {len(tasks)} tasks with pass rate in "
        f"[{args.lo}, {args.hi}] -> {out}"
    )
    return 0


def kept_row(env: Environment, task: Task, pass_rate: float) -> dict[str, Any]:
    """The filter's output row of ``task``: the dataset row when the environment reads one
    (same columns, so the file is a dataset of that environment), else ``problem``/``answer``;
    plus ``problem_id`` (read back by ``env.train_subset``) and ``pass_rate``."""
    return {**env.record(task.problem_id), "problem_id": task.problem_id, "pass_rate": pass_rate}


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser(verb).parse_args(list(argv))
    _quiet()
    return {"sft": sft_main, "eval": eval_main, "filter": filter_main}[verb](args)
