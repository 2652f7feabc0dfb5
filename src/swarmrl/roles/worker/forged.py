"""TEST-ONLY: a worker that forges the environment's turns of its multi-turn episodes.

The worker runs the environment, so what it submits as a tool result or game feedback is a
claim. :func:`forging` returns the environment such a worker would use: the same task, limits
and rules, but each environment turn changed before the model reads it: every number in it
moved by one (a tool result that is not the tool's: ``[201954]`` → ``[201955]``, a game's
range that lies), where the turn has no number, ``<`` and ``>`` swapped (lower and higher),
and a turn with neither (a refused call's ``[?]``) replaced by a made-up result, ``[1]``. The
model's later turns then read the forged text, as they would under a real forger; the trusted
side's recomputation of each environment turn (``swarmrl.trainer.episode_check``) is what catches it.

A verifiers taskset's environment turns are written by its harness program; the forger of
those (:func:`forging_harness`) plays a tampered harness instead: the harness config's ``lie``
field set to 1, which the tests' harness (``swarmrl.testing.vf1``) adds to every tool result
and to its follow-up question. A harness without that field cannot be tampered with this way
(a one-line :class:`~swarmrl.errors.ConfigError` at the worker's start).

Knows nothing about pools or proofs.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence

from swarmrl.config.env import EnvConfig
from swarmrl.envs import Environment, Task, build_env
from swarmrl.envs.multiturn import Message, MultiTurnEnvironment, Reply
from swarmrl.envs.vf1 import VerifiersV1Env
from swarmrl.errors import ConfigError

_NUMBER = re.compile(r"\d+")
_SWAP = {"<": ">", ">": "<"}
FORGED_RESULT = "[1]"  # what a turn with neither becomes: a made-up tool result


def forge_text(text: str) -> str:
    """``text`` as a forger rewrites it (module docstring)."""
    if _NUMBER.search(text):
        return _NUMBER.sub(lambda m: str(int(m.group()) + 1), text)
    swapped = re.sub(r"[<>]", lambda m: _SWAP[m.group()], text)
    return swapped if swapped != text else FORGED_RESULT


def forging(env: MultiTurnEnvironment) -> MultiTurnEnvironment:
    """A copy of ``env`` whose every environment turn is forged (module docstring)."""
    honest = env.reply
    forged = copy.copy(env)

    def reply(task: Task, seed: int, transcript: Sequence[Message]) -> Reply:
        answer = honest(task, seed, transcript)
        return Reply(forge_text(answer.text), answer.done)

    forged.reply = reply  # type: ignore[method-assign]
    return forged


def forger_for(config: EnvConfig, env: Environment, cheat: str) -> Environment:
    """The environment a worker forging ``env``'s turns plays (:func:`forging_harness` for a
    verifiers taskset, :func:`forging` for a multi-turn one); a one-line ConfigError for a
    single-turn ``env``, which has no turns to forge."""
    if isinstance(env, VerifiersV1Env):
        return forging_harness(config)  # refused at start without `lie`
    if isinstance(env, MultiTurnEnvironment):
        return forging(env)
    raise ConfigError(
        f"swarm.cheat = {cheat!r} forges environment turns: env.name = {config.name!r} is "
        "single-turn"
    )


def forging_harness(config: EnvConfig) -> Environment:
    """The environment of ``config`` (a verifiers taskset) played by a tampered harness
    (module docstring)."""
    tampered = {**config.verifiers_harness_args, "lie": 1}
    return build_env(config.model_copy(update={"verifiers_harness_args": tampered}), scores=False)
