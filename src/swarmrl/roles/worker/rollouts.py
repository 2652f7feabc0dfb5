"""Turn one leased work unit into signed-ready samples: prompts, seeded generation, proofs.

A unit of a multi-turn environment is answered with episodes (:func:`generate_episodes`).

A work unit names task indices into the pool's training split, ``samples_per_task`` (G) and a
unit seed. Sample ``i`` (tasks in lease order, G consecutive samples per task) is generated with
seed ``sample_seed(unit seed, i)`` (``swarmrl.protocol.seeds``), so a validator knows every
sample's Gumbel noise without trusting the worker. Prompts are ``<bos> + prompt characters``,
the layout the warm start trained on.

Also holds the test-only misbehaviour :func:`corrupt_weights` used to show that a worker
generating with other weights than the declared version is caught.

Knows nothing about HTTP or pools beyond the wire types of a work unit and a sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from swarmrl.envs import Environment
from swarmrl.envs.multiturn import MultiTurnEnvironment
from swarmrl.inference.types import Generation
from swarmrl.model.prompts import encode_prompt
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Sample, WorkUnit
from swarmrl.protocol.seeds import sample_seed
from swarmrl.trainer.episodes import EpisodeState, run_episodes

# generations of one unit (with hidden states) -> one wire proof bundle per generation
ProofBuilder = Callable[[list[Generation], SamplingParams], list[dict | str | None]]


def unit_prompts(
    env: Environment, tokenizer: PreTrainedTokenizerBase, work: WorkUnit
) -> list[tuple[int, list[int]]]:
    """``(task index, prompt tokens)`` for every sample of ``work``, G per task, in order."""
    out: list[tuple[int, list[int]]] = []
    for task_index in work.task_indices:
        tokens = encode_prompt(tokenizer, env.task("train", task_index))
        out.extend((task_index, tokens) for _ in range(work.samples_per_task))
    return out


class Generator(Protocol):
    """Anything with the engine's ``generate`` verb (see ``swarmrl.inference.engine``)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int],
        *,
        return_hidden: bool = False,
    ) -> list[Generation]: ...


def generate_unit(
    engine: Generator,
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    work: WorkUnit,
    policy_version: int,
    prove: ProofBuilder | None = None,
) -> list[Sample]:
    """All ``len(task_indices) × G`` samples of ``work`` generated with ``policy_version``."""
    prompts = unit_prompts(env, tokenizer, work)
    seeds = [sample_seed(work.seed, i) for i in range(len(prompts))]
    params = work.sampling  # the validator replays with exactly these
    generations = engine.generate(
        [p for _, p in prompts], params, seeds, return_hidden=prove is not None
    )
    proofs = prove(generations, params) if prove is not None else [None] * len(generations)
    samples = []
    for (task_index, _), gen, proof in zip(prompts, generations, proofs, strict=True):
        samples.append(
            Sample(
                task_index=task_index,
                prompt_tokens=gen.prompt_tokens,
                output_tokens=gen.output_tokens,
                logprobs=gen.logprobs,
                finish_reason=gen.finish_reason,
                policy_version=policy_version,
                proof=proof,
            )
        )
    return samples


def generate_episodes(
    engine: Generator,
    env: MultiTurnEnvironment,
    tokenizer: PreTrainedTokenizerBase,
    work: WorkUnit,
    policy_version: int,
    prove: ProofBuilder | None = None,
) -> list[Sample]:
    """All ``len(task_indices) × G`` episodes of ``work`` (``swarmrl.protocol.pool.Sample``'s
    episode form), run batched across episodes: episode ``i`` has seed ``sample_seed(unit
    seed, i)`` and its call k samples with ``derive_seed("turn", that seed, k)``, so a validator
    knows every call's noise; each call is proven as it is generated."""
    tasks = [env.task("train", t) for t in work.task_indices for _ in range(work.samples_per_task)]
    indices = [t for t in work.task_indices for _ in range(work.samples_per_task)]
    seeds = [sample_seed(work.seed, i) for i in range(len(tasks))]
    proofs: dict[int, list[dict | str | None]] = {}
    finish: dict[int, str] = {}

    def on_turn(batch: list[EpisodeState], gens: list[Generation], params: SamplingParams) -> None:
        built = prove(gens, params) if prove is not None else [None] * len(gens)
        for state, gen, proof in zip(batch, gens, built, strict=True):
            proofs.setdefault(id(state), []).append(proof)
            finish[id(state)] = gen.finish_reason

    states = run_episodes(env, engine, tokenizer, tasks, seeds, work.sampling, on_turn)
    samples = []
    for task_index, state in zip(indices, states, strict=True):
        episode = state.episode()
        first = episode.segments[0]
        samples.append(
            Sample(
                task_index=task_index,
                prompt_tokens=first.tokens[: first.turns[0].end],
                output_tokens=[t for c in state.calls for t in c.output_tokens],
                logprobs=[x for c in state.calls for x in c.logprobs],
                finish_reason=finish[id(state)],
                policy_version=policy_version,
                episode=episode,
                turn_proofs=proofs[id(state)] if prove is not None else None,
            )
        )
    return samples


def corrupt_weights(
    state_dict: dict[str, torch.Tensor], scale: float = 0.5, seed: int = 0
) -> dict[str, torch.Tensor]:
    """TEST-ONLY: every floating tensor plus Gaussian noise of ``scale`` × its own std.

    Models a worker that saves compute or tampers by decoding with different weights while
    declaring the published version.
    """
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and tensor.numel() > 1:
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            out[name] = tensor + (scale * tensor.float().std() * noise).to(tensor.dtype)
        else:
            out[name] = tensor
    return out
