"""The trusted side's check of harness episodes (``swarmrl.envs.vf1``) an untrusted worker claims.

A worker plays a verifiers taskset with its harness program, so every environment turn it
submits (a tool result, a simulated user's message) is a claim. Where the harness is declared
deterministic given the model's turns (``env.verifiers_reexecute``), the trusted side plays each
episode again: the same harness, task and episode seed, with a scripted model that answers call
k of the episode with the tokens the episode claims for call k (:class:`ScriptedEngine`, behind
the same token endpoint the worker's engine was behind). The harness renders every prompt here,
from its own tool results; the replayed episode must equal the claimed one token for token and
turn for turn. The first difference is the rejection, with one reason:

=================  =====================================================================
``call_count``     the replayed harness made another number of model calls (it asked for a
                   call the episode does not have, or stopped before the episode's last)
``env_mismatch``   call k's prompt differs from the one the replayed harness rendered: an
                   environment turn (or the history before it) that is not the harness's
``over_budget``    a claimed model turn longer than the token limit the harness asked for
``harness``        the harness failed when replayed with the episode's model turns
=================  =====================================================================

A replay that runs past ``env.verifiers_timeout_s`` proves nothing against the worker (the
trusted side's machine may be the slow one): :attr:`Rerun.own_failure` says so; the validator
drops the unit without a ban (a soft rejection, never judged again: an episode crafted to make
the harness hang costs one timeout, not one per claim) and the trainer does not train it.

What this proves: the environment turns, the turn structure and the reward are what this
harness gives for these model turns; the reward is the taskset's, computed on the replayed
trace (its messages parsed here). What it does not: that the model turns were sampled by the
policy (the proofs' and the sampling replay's part, ``swarmrl.toploc``, on :attr:`Rerun.calls`
with :attr:`Rerun.sampling`), and anything about a harness that is not deterministic (its honest
episodes are rejected: do not declare it so).

Knows nothing about proofs, the pool or the network.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from swarmrl.envs import Task
from swarmrl.envs.vf1 import HarnessEpisode, VerifiersV1Env
from swarmrl.errors import HarnessFailed, HarnessTimedOut
from swarmrl.inference.token_endpoint import serve_engine
from swarmrl.inference.types import Generation
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.episodes import Episode, ModelCall
from swarmrl.protocol.seeds import derive_seed


@dataclass
class Rerun:
    """One episode replayed: a rejection (``reason: detail``), a failure of this side's own
    (``own_failure``: judge again later), or the calls as the harness asked them here (prompts
    rendered here, outputs and log-probs the episode's), the sampling each call asked for (the
    harness's request over the lease's: its token limit, its stop tokens), the reward."""

    rejection: str = ""
    own_failure: str = ""
    calls: list[ModelCall] = field(default_factory=list)
    sampling: list[SamplingParams] = field(default_factory=list)
    reward: float = 0.0
    correct: bool = False


class ScriptedEngine:
    """An engine that answers call k of episode e with the tokens ``episodes[e]`` claims for it;
    a call is known by its seed (``derive_seed("turn", episode seed, k)``, what the token
    endpoint derives). A call the episodes do not have, or a claimed answer longer than the
    limit asked for, is refused (``ValueError``: the endpoint refuses that request alone) and
    recorded in :attr:`refused`."""

    def __init__(self, episodes: Sequence[Episode], stop_token_ids: set[int]) -> None:
        self.stops = stop_token_ids
        self.script: dict[int, tuple[int, int, ModelCall]] = {}
        self.counts: list[int] = []
        for e, episode in enumerate(episodes):
            calls = episode.calls()
            for k, call in enumerate(calls):
                self.script[derive_seed("turn", episode.seed, k)] = (e, k, call)
            self.counts.append(len(calls))
        # the call after each episode's last: a harness that asks for it plays another episode
        self.beyond = {
            derive_seed("turn", ep.seed, n): e
            for e, (ep, n) in enumerate(zip(episodes, self.counts, strict=True))
        }
        self._lock = threading.Lock()
        self.sampling: dict[int, SamplingParams] = {}  # by turn seed: what the harness asked for
        self.refused: dict[int, str] = {}  # by episode: the first refusal, as a rejection

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int],
        *,
        return_hidden: bool = False,
    ) -> list[Generation]:
        out = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            entry = self.script.get(seed)
            if entry is None:
                if seed in self.beyond:
                    e = self.beyond[seed]
                    self._refuse(
                        e,
                        f"call_count: the harness asked for call {self.counts[e]}; the episode "
                        f"ends after {self.counts[e]} calls",
                    )
                raise ValueError("a model call the episode does not have")
            e, k, call = entry
            if len(call.output_tokens) > params.max_new_tokens:
                self._refuse(
                    e,
                    f"over_budget: call {k} claims {len(call.output_tokens)} tokens where the "
                    f"harness allowed {params.max_new_tokens}",
                )
                raise ValueError(f"call {k} is over its token limit")
            with self._lock:
                self.sampling[seed] = params
            ended = bool(call.output_tokens) and call.output_tokens[-1] in (
                self.stops | set(params.stop_token_ids)
            )
            out.append(
                Generation(
                    list(prompt),
                    list(call.output_tokens),
                    list(call.logprobs),
                    "eos" if ended else "length",
                    seed,
                )
            )
        return out

    def _refuse(self, episode: int, rejection: str) -> None:
        with self._lock:
            self.refused.setdefault(episode, rejection)


def rerun_episodes(
    env: VerifiersV1Env,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    episodes: Sequence[Episode],
    params: SamplingParams,
) -> list[Rerun]:
    """Each of ``episodes`` (episode i claims to play ``tasks[i]``) replayed by ``env``'s
    harness with its own model turns, all at once (module docstring). ``params``: the sampling
    the unit was leased with (its ``max_new_tokens`` bounds every call)."""
    stops = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    engine = ScriptedEngine(episodes, stops)
    with tempfile.TemporaryDirectory(prefix="swarmrl-rerun-") as scratch:
        tokenizer.save_pretrained(scratch)  # what the harness's renderer loads
        with serve_engine(engine, params) as endpoint:  # type: ignore[arg-type]
            played = env.play_each(tasks, [ep.seed for ep in episodes], endpoint, scratch, params)
    return [
        _compare(i, episode, outcome, engine)
        for i, (episode, outcome) in enumerate(zip(episodes, played, strict=True))
    ]


def _compare(
    i: int, claimed: Episode, outcome: HarnessEpisode | HarnessFailed, engine: ScriptedEngine
) -> Rerun:
    if i in engine.refused:
        return Rerun(rejection=engine.refused[i])
    if isinstance(outcome, HarnessTimedOut):
        return Rerun(own_failure=f"replaying the harness: {outcome}")
    if isinstance(outcome, HarnessFailed):
        return Rerun(rejection=f"harness: it failed when replayed: {outcome}")
    replayed = outcome.episode
    calls, claims = replayed.calls(), claimed.calls()
    if len(calls) != len(claims):
        return Rerun(
            rejection=f"call_count: the harness made {len(calls)} model calls; the episode "
            f"has {len(claims)}"
        )
    for k, (ours, theirs) in enumerate(zip(calls, claims, strict=True)):
        if ours.prompt_tokens != theirs.prompt_tokens:
            return Rerun(
                rejection=f"env_mismatch: call {k}'s prompt differs from the harness's at "
                f"token {_first_difference(ours.prompt_tokens, theirs.prompt_tokens)}"
            )
    shapes = [(s.tokens, s.turns) for s in replayed.segments]
    if shapes != [(s.tokens, s.turns) for s in claimed.segments]:
        return Rerun(rejection="env_mismatch: the episode's segments are not the harness's")
    sampling = [engine.sampling[derive_seed("turn", claimed.seed, k)] for k in range(len(calls))]
    reward = replayed.reward if replayed.reward is not None else 0.0
    return Rerun(calls=claims, sampling=sampling, reward=reward, correct=reward == 1.0)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
