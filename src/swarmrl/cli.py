"""The ``swarmrl`` command: a table of verbs, each owned by the subpackage that implements it.

The top level parses only the verb, then imports the owning module and hands it the remaining
arguments, so ``swarmrl relay`` never imports torch and ``swarmrl --help`` is instant.
Every :class:`swarmrl.errors.UserError` becomes one line on stderr and exit status 2. A verb that
is a whole run (``run``, ``demo``) is refused under torchrun with several ranks, which would
start one independent run per rank.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from swarmrl.errors import SwarmError, UserError

# verb -> (module whose ``main(verb, argv) -> int`` runs it, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "demo": ("swarmrl.launch.cli", "run the embedded default swarm on this machine"),
    "run": ("swarmrl.launch.cli", "run a config: a whole local swarm, or --colocated"),
    "sft": ("swarmrl.trainer.cli", "warm-start a model by supervised fine-tuning"),
    "eval": ("swarmrl.trainer.cli", "held-out accuracy of a model on a task"),
    "filter": ("swarmrl.trainer.cli", "keep tasks whose pass rate lies in [lo, hi]"),
    "toploc": ("swarmrl.toploc.cli", "verifiable-inference tools (calibrate thresholds)"),
    "shardcast": ("swarmrl.shardcast.cli", "publish and fetch signed weight versions"),
    "relay": ("swarmrl.roles.relay.cli", "run a weight relay following upstreams"),
    "keys": ("swarmrl.identity.cli", "make ed25519 key files"),
    "config": ("swarmrl.config.reference", "show every config key, its value and description"),
    "pool": ("swarmrl.pool.cli", "pool administration (invites)"),
    "orchestrator": ("swarmrl.roles.orchestrator.cli", "run the pool service"),
    "ledger": ("swarmrl.ledger.cli", "export and verify the contribution ledger"),
    # the role, plus the run directory swarmrl run writes (swarmrl.launch.handrun)
    "trainer": ("swarmrl.launch.handrun", "run the trusted trainer role"),
    "worker": ("swarmrl.roles.worker.cli", "run an untrusted inference worker"),
    "validator": ("swarmrl.roles.validator.cli", "run a trusted validator"),
    "serve": ("swarmrl.tools.serve", "serve a trained policy with an OpenAI-compatible API"),
    "dashboard": ("swarmrl.tools.dashboard", "serve the read-only web dashboard of a run"),
    "report": ("swarmrl.launch.handrun", "write a run's report.json and report.png again"),
}


def _usage() -> str:
    width = max(len(v) for v in VERBS)
    lines = ["usage: swarmrl VERB [options]   (swarmrl VERB --help for a verb's options)", ""]
    lines += [f"  {verb.ljust(width)}  {help_}" for verb, (_, help_) in VERBS.items()]
    return "\n".join(lines)


# verbs that are a whole run each: under torchrun every rank would start one of its own
WHOLE_RUN_VERBS = {"run", "demo"}


def refuse_under_torchrun(verb: str) -> None:
    """A :class:`UserError` when ``verb`` starts a whole run and this process is one of several
    torchrun ranks (``WORLD_SIZE`` > 1): the colocated loop is one process, and ``swarmrl run``
    starts its trainer under torchrun itself (``trainer.nproc``)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if verb in WHOLE_RUN_VERBS and world > 1:
        raise UserError(
            f"under torchrun (WORLD_SIZE={world}) every rank would start a run of its own: "
            f"start `swarmrl {verb}` once, without torchrun (for a trainer sharded over {world} "
            f"ranks run the swarm with --set trainer.nproc={world})"
        )


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from swarmrl import __version__

        print(__version__)
        return 0
    verb, rest = args[0], args[1:]
    if verb not in VERBS:
        print(f"swarmrl: unknown verb {verb!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, _ = VERBS[verb]
    try:
        refuse_under_torchrun(verb)
        module = importlib.import_module(module_name)
        return int(module.main(verb, rest) or 0)
    except UserError as exc:
        print(f"swarmrl {verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"swarmrl {verb}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``swarmrl … | head -1``): not an error
        _silence_stdout()
        return 0
    except SwarmError as exc:
        print(f"swarmrl {verb}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
