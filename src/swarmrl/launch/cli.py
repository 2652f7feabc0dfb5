"""``swarmrl run CONFIG [--colocated] [--set key=value ...]`` and ``swarmrl demo``.

``run --colocated`` generates and trains in one process (``swarmrl.trainer.colocated``); without
it, the whole swarm runs on this machine (``swarmrl.launch.swarm``). ``demo`` runs the embedded
default config (``configs/arith.toml``) as a local swarm with one cheating worker. Either way
the run directory gets ``config.json``, ``metrics.jsonl``, ``report.json`` and ``report.png``
(``swarmrl.launch.report``) and the last line printed says where it is.

Knows how to wire config, trainer and report together; nothing about the maths.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmrl.config import EMBEDDED_DEFAULT, SwarmConfig, load_config
from swarmrl.config.args import add_override_args
from swarmrl.errors import interrupted

VERB_HELP = {
    "demo": "run the embedded default swarm on this machine (one cheating worker included)",
    "run": "run a config: a whole local swarm, or generation and training in one process",
}


def _parser(verb: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"swarmrl {verb}", description=VERB_HELP[verb])
    if verb == "run":
        parser.add_argument("config", help="TOML config file (see configs/)")
        parser.add_argument(
            "--colocated",
            action="store_true",
            help="generate and train in one process instead of a local swarm",
        )
    add_override_args(parser)
    parser.add_argument("--quiet", action="store_true", help="no live display")
    return parser


def _quiet_libraries() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_colocated_cli(config: SwarmConfig, quiet: bool) -> Path:
    """A colocated run recorded as it goes; Ctrl-C (or an error) still leaves report.json with
    status ``interrupted`` (``failed``), every finished step and evaluation, and policy/ once
    RL is over."""
    from swarmrl.launch.report import ProgressView, RunRecorder, failure_reason, full_disk
    from swarmrl.model.io import save_policy
    from swarmrl.rolekit.supervisor import terminate_as_interrupt
    from swarmrl.trainer.colocated import run_colocated
    from swarmrl.trainer.learner import Learner
    from swarmrl.trainer.loop import Hooks
    from swarmrl.trainer.trackers import Trackers, tracked

    _quiet_libraries()
    recorder = RunRecorder(config, mode="colocated")
    view = ProgressView(config.rl.steps, config.sft.steps)
    if quiet:
        view.live = None
        view.console.quiet = True

    def on_step(row: dict[str, Any]) -> None:
        recorder.log_step(row)
        recorder.progress()
        view.on_step(row)

    def on_eval(name: str, result: dict[str, Any]) -> None:
        recorder.progress()
        view.on_eval(name, result)

    def on_rl_end(learner: Learner) -> None:
        save_policy(learner.policy, learner.tokenizer, recorder.dir / "policy")

    hooks = Hooks(
        on_phase=view.on_phase,
        on_step=on_step,
        on_eval=on_eval,
        on_start=recorder.follow,
        on_rl_end=on_rl_end,
    )
    try:
        with terminate_as_interrupt(), Trackers(config, recorder.dir) as trackers, view:
            run_colocated(config, tracked(hooks, trackers), on_sft_step=view.on_sft_step)
    except BaseException as exc:
        if interrupted(exc):  # Ctrl-C, or SIGTERM through terminate_as_interrupt
            recorder.finish("interrupted")
            print(f"interrupted; what had finished is in {recorder.dir}", file=sys.stderr)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise KeyboardInterrupt from exc  # an error a library raised as it unwound
        full = full_disk(recorder.dir, exc)
        recorder.finish("failed", reason=failure_reason(full or exc))
        if full is not None:
            raise full from exc
        raise
    report = recorder.finish("completed")
    ev = report["eval"]
    control = ev.get("control", {}).get("accuracy")
    print(
        f"held-out accuracy (n={ev['n']}): {ev['before']['accuracy']:.1%} -> "
        f"{ev['after']['accuracy']:.1%}"
        + (f" (control, SFT continued: {control:.1%})" if control is not None else "")
        + f" in {report['wall_seconds']:.0f} s; run directory: {recorder.dir}"
    )
    return recorder.dir


def run_swarm_cli(config: SwarmConfig, quiet: bool) -> Path:
    from swarmrl.envs import build_env
    from swarmrl.envs.multiturn import require_recomputable
    from swarmrl.launch.facts import summary_text
    from swarmrl.launch.report import new_run_dir
    from swarmrl.launch.swarm import run_swarm

    require_recomputable(build_env(config.env, scores=False))
    _quiet_libraries()
    run_dir = new_run_dir(config)
    try:
        report = run_swarm(config, run_dir, display=not quiet)
    except KeyboardInterrupt:
        print(f"interrupted; what had finished is in {run_dir}", file=sys.stderr)
        raise
    print(summary_text(report) + f"\nrun directory: {run_dir}")
    return run_dir


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser(verb).parse_args(list(argv))
    if verb == "demo":
        from swarmrl.launch.swarm import DEMO_OVERRIDES

        config = load_config([EMBEDDED_DEFAULT], [*DEMO_OVERRIDES, *args.overrides])
        run_swarm_cli(config, args.quiet)
        return 0
    config = load_config([args.config], args.overrides)
    if args.colocated:
        run_colocated_cli(config, args.quiet)
    else:
        run_swarm_cli(config, args.quiet)
    return 0
