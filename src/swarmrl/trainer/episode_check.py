"""The trusted side's check of an episode an untrusted worker claims.

A worker runs the environment, so every environment turn it submits is a claim. The check
recomputes the whole episode from the task, the seed and the claimed model turns alone: it
feeds each claimed model turn, in order, to the same rule the driver uses
(:class:`swarmrl.trainer.episodes.EpisodeState`), which renders each prompt and asks the
environment for its reply, and then compares the recomputed episode with the claimed one turn
by turn. The first difference is the rejection, with one reason:

====================  ================================================================
``over_turns``        more model turns than ``env.max_turns``
``over_budget``       more model + environment tokens than ``env.token_budget``, or a
                      model turn longer than the call allowed
``model_past_stop``   a model turn goes on after a stop token (a model stops there: what
                      follows was not sampled)
``env_as_model``      a turn marked as sampled where the environment's turn belongs
                      (environment tokens claimed as model tokens, or the turn dropped)
``env_mismatch``      an environment turn whose tokens differ from the recomputed reply
                      (a forged tool result, a flattering game reply)
``context_mismatch``  a segment's context differs from the recomputed rendering (not the
                      task's prompt, or history rewritten)
``turn_order``        turns in another order than the episode has them
``after_end``         turns after the point where the episode ended
``cut_short``         the episode stops where the environment continues it
====================  ================================================================

What this proves: the environment turns and the turn structure (the mask) are exactly what the
environment gives for these model turns. What it does not: that the model turns were sampled
by the policy with the episode's seeds. That is the proof's and the sampling replay's part
(``swarmrl.toploc``), over model tokens only; this check hands back the recomputed episode
whose calls (prompt and sampled tokens) those checks replay.

Knows nothing about proofs, the pool or the network.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from swarmrl.envs import Task
from swarmrl.envs.multiturn import MultiTurnEnvironment
from swarmrl.protocol.episodes import Episode
from swarmrl.trainer.episodes import EpisodeState


@dataclass(frozen=True)
class EpisodeRejection:
    """Why an episode is refused: a reason code (module docstring) and one line of detail."""

    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


def check_episode(
    env: MultiTurnEnvironment,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    episode: Episode,
    max_new_tokens: int,
) -> EpisodeRejection | None:
    """None when ``episode`` is exactly what ``env`` gives for its model turns, else the first
    reason it is not (module docstring). ``max_new_tokens``: the sampling limit per call."""
    return replay_episode(env, tokenizer, task, episode, max_new_tokens)[0]


def replay_episode(
    env: MultiTurnEnvironment,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    episode: Episode,
    max_new_tokens: int,
) -> tuple[EpisodeRejection | None, EpisodeState | None]:
    """:func:`check_episode`'s verdict and, when it passes, the recomputed episode: its
    transcript (what the reward is computed from), each call's prompt and token limit (what
    each call's proof and sampling are checked against)."""
    calls = episode.calls()
    if len(calls) > env.max_turns:
        return EpisodeRejection(
            "over_turns", f"{len(calls)} model turns, the limit is {env.max_turns}"
        ), None
    if episode.budget_tokens() > env.token_budget:
        return EpisodeRejection(
            "over_budget",
            f"{episode.budget_tokens()} model + environment tokens, the budget is "
            f"{env.token_budget}",
        ), None
    stops = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    for k, call in enumerate(calls):
        early = [j for j, t in enumerate(call.output_tokens[:-1]) if t in stops]
        if early:
            return EpisodeRejection(
                "model_past_stop",
                f"model turn {k} continues after its stop token at token {early[0]}",
            ), None
    state = EpisodeState.start(env, tokenizer, task, episode.seed, max_new_tokens)
    for k, call in enumerate(calls):
        if state.ended:
            break  # the structural comparison names what follows the end
        if len(call.output_tokens) > state.next_max:
            return EpisodeRejection(
                "over_budget",
                f"model turn {k} has {len(call.output_tokens)} tokens, the call allowed "
                f"{state.next_max}",
            ), None
        state.record(env, tokenizer, call.output_tokens, call.logprobs, max_new_tokens)
    rejection = compare(state.episode(), episode, continues=not state.ended)
    return rejection, (None if rejection else state)


def _flat(episode: Episode) -> list[tuple[int, str, list[int]]]:
    return [(i, turn.role, episode.segments[i].span(turn)) for i, turn in episode.turns()]


def compare(expected: Episode, claimed: Episode, continues: bool) -> EpisodeRejection | None:
    """The first difference between the recomputed and the claimed turns (``continues``: the
    recomputed episode had not ended after the claimed model turns)."""
    want, got = _flat(expected), _flat(claimed)
    for i, ((seg_w, role_w, tok_w), (seg_g, role_g, tok_g)) in enumerate(
        zip(want, got, strict=False)
    ):
        if role_g == "model" and role_w == "env":
            return EpisodeRejection(
                "env_as_model",
                f"turn {i} is marked as sampled where the environment's turn belongs",
            )
        if role_w != role_g:
            return EpisodeRejection("turn_order", f"turn {i} is {role_g} where {role_w} belongs")
        if tok_w != tok_g or seg_w != seg_g:
            first = next(
                (j for j, (a, b) in enumerate(zip(tok_w, tok_g, strict=False)) if a != b),
                min(len(tok_w), len(tok_g)),
            )
            reason = {"env": "env_mismatch", "context": "context_mismatch"}.get(role_w)
            if reason is None:  # model turns are the claim's own: only their segment can differ
                return EpisodeRejection("turn_order", f"turn {i} is in another segment")
            return EpisodeRejection(
                reason,
                f"turn {i} ({role_w}) differs from its recomputation at token {first}",
            )
    if len(got) > len(want):
        return EpisodeRejection(
            "after_end",
            f"the episode ends after turn {len(want) - 1}; {len(got) - len(want)} "
            "more turns follow",
        )
    if len(got) < len(want) or continues:
        return EpisodeRejection(
            "cut_short",
            f"the episode stops after turn {len(got) - 1} where the environment continues it",
        )
    return None
