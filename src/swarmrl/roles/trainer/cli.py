"""``swarmrl trainer``: the trusted trainer of a swarm. Owns the optimizer, runs the origin.

    swarmrl trainer [CONFIG] --key trainer.key --orchestrator URL --pool ID --run-dir DIR
                    [--origin-host 0.0.0.0] [--origin-port 8470]

The key is the pool owner's: it signs the published versions and the trainer's admin calls.
The process runs the learning library's one training loop (``swarmrl.trainer.loop.train``,
the same as a colocated run) over the pool (:class:`~swarmrl.roles.trainer.source.PoolSource`).
One step ``n`` (DESIGN.md §2–3):

1. lease accepted rollouts from the orchestrator (versions ≥ n − async_level), regrouped by
   task, rewards recomputed, informative groups only; wait, bounded, until
   ``prompts_per_step`` groups are there;
2. one optimizer step whose importance ratio is taken against the validator's replayed
   log-probs of the behaviour version (the trusted behaviour policy);
3. commit: publish version n + 1 through shardcast (the origin serves it at once) and tell the
   orchestrator, so leases and staleness checks move on; then acknowledge the rollouts the
   step used up (unacknowledged ones return to the orchestrator's queue).

Under ``torchrun --nproc-per-node N -m swarmrl.cli trainer …`` (or ``[trainer] nproc = N`` in
``swarmrl run``) every rank runs the loop on its shard of the model; rank 0 alone talks to the
orchestrator and publishes.

Checkpoints (``[trainer] checkpoint_every``; default directory ``RUN_DIR/trainer/checkpoints``)
hold the model, optimizer, RNG, step, version and where the trainer is in the rollout stream; a
restarted trainer continues from the newest one (from the warm start when there is none), and
publishes the weights it continues with under a version number past any published or told
before, never reusing one.

Version 0 is published before the loop starts. As it goes the process writes
``RUN_DIR/trainer/summary.json``: the loop's result (``training``: the same record a colocated
run reports), what the origin published (``origin``) and the submissions it acknowledged. A
trainer started by hand also writes what ``swarmrl run`` writes at the top of ``RUN_DIR``
(config.json, metrics.jsonl, report.json with the pool's closing account, report.png,
ledger.jsonl) and prints the same closing summary; ``--no-report`` leaves them to a launcher.
After RL, ``eval.control`` continues the warm start's SFT for the RL's time less its waits for
rollouts (logged when it starts and ends).

Knows nothing about how rollouts were produced or checked beyond the wire types.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from swarmrl.rolekit.toolkit import add_role_args, add_tls_args, end_process
from swarmrl.serving import Tls

if TYPE_CHECKING:
    from swarmrl.roles.trainer.process import OpenReport


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmrl trainer",
        description="run the trusted trainer: take accepted rollouts, step, publish versions",
    )
    add_role_args(parser)
    parser.add_argument("--orchestrator", required=True, help="orchestrator URL")
    parser.add_argument("--pool", default="swarm", help="pool id (this key must own it)")
    parser.add_argument("--run-dir", required=True, help="where the origin store and report go")
    parser.add_argument("--origin-host", default="127.0.0.1", help="address the origin binds")
    parser.add_argument("--origin-port", type=int, default=8470, help="origin port; 0 = any")
    add_tls_args(parser, "the origin serves HTTPS with")
    parser.add_argument(
        "--no-report",
        action="store_true",
        help="leave RUN_DIR's report.json, report.png and metrics.jsonl to a launcher "
        "(swarmrl run passes it); by default the trainer writes them as swarmrl run does",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="require a checkpoint to continue from (one found is resumed even without this)",
    )
    return parser


def main(verb: str, argv: Sequence[str], open_report: OpenReport | None = None) -> int:
    """``open_report`` (given by ``swarmrl.launch.handrun``, which owns the verb) writes the run
    directory's report unless ``--no-report``."""
    args = _parser().parse_args(list(argv))
    Tls.from_flags(args.tls_cert, args.tls_key)  # refused before minutes of warm start
    # the heavy imports (torch, transformers) come after parsing: ``--help`` answers at once
    from swarmrl.roles.trainer.process import start

    code = start(args, None if args.no_report else open_report)
    # every rank: the status written, the logs flushed, torch's native threads left running
    # (swarmrl.rolekit.toolkit.end_process)
    end_process(code)
