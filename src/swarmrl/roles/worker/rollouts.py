"""Turn one leased work unit into signed-ready samples: prompts, seeded generation, proofs.

A unit of a multi-turn environment is answered with episodes (:func:`generate_episodes`), one
of a verifiers taskset with episodes its harness plays (:func:`generate_harness_episodes`).

A work unit names task indices into the pool's training split, ``samples_per_task`` (G) and a
unit seed. Sample ``i`` (tasks in lease order, G consecutive samples per task) is generated with
seed ``sample_seed(unit seed, i)`` (``swarmrl.protocol.seeds``), so a validator knows every
sample's Gumbel noise without trusting the worker. Prompts are ``<bos> + prompt characters``,
the layout the warm start trained on.

Also holds the test-only misbehaviour :func:`corrupt_weights` used to show that a worker
generating with other weights than the declared version is caught.

Knows nothing about pools beyond the wire types of a work unit and a sample (a harness talks
to the engine over loopback HTTP, ``swarmrl.inference.token_endpoint``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from swarmrl.envs import Environment, Task
from swarmrl.envs.multiturn import MultiTurnEnvironment
from swarmrl.envs.vf1 import VerifiersV1Env
from swarmrl.inference.interface import Engine
from swarmrl.inference.token_endpoint import Prover, serve_engine
from swarmrl.inference.types import Generation
from swarmrl.model.prompts import encode_prompt
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.episodes import Episode
from swarmrl.protocol.pool import Sample, WorkUnit
from swarmrl.protocol.seeds import sample_seed
from swarmrl.trainer.episodes import EpisodeState, run_episodes


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
    prove: Prover | None = None,
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
    prove: Prover | None = None,
) -> list[Sample]:
    """All ``len(task_indices) × G`` episodes of ``work`` (``swarmrl.protocol.pool.Sample``'s
    episode form), run batched across episodes: episode ``i`` has seed ``sample_seed(unit
    seed, i)`` and its call k samples with ``derive_seed("turn", that seed, k)``, so a validator
    knows every call's noise; each call is proven as it is generated."""
    indices, tasks, seeds = _unit_episodes(env, work)
    proofs: dict[int, list[dict | str | None]] = {}
    finish: dict[int, str] = {}

    def on_turn(batch: list[EpisodeState], gens: list[Generation], params: SamplingParams) -> None:
        built = prove(gens, params) if prove is not None else [None] * len(gens)
        for state, gen, proof in zip(batch, gens, built, strict=True):
            proofs.setdefault(id(state), []).append(proof)
            finish[id(state)] = gen.finish_reason

    states = run_episodes(env, engine, tokenizer, tasks, seeds, work.sampling, on_turn)
    return [
        _episode_sample(t, state.episode(), finish[id(state)], policy_version, proofs[id(state)])
        for t, state in zip(indices, states, strict=True)
    ]


def generate_harness_episodes(
    engine: Engine,
    env: VerifiersV1Env,
    tokenizer: PreTrainedTokenizerBase,
    tokenizer_dir: str,
    work: WorkUnit,
    policy_version: int,
    prove: Prover | None = None,
) -> list[Sample]:
    """All ``len(task_indices) × G`` episodes of ``work`` for a verifiers taskset, played by
    its harness at once (``swarmrl.envs.vf1``), the engine behind a token endpoint that proves
    each call as it samples it; seeds as in :func:`generate_episodes`. ``tokenizer_dir``: the
    policy's tokenizer, saved (what the harness's renderer loads). A harness that fails raises
    its :class:`~swarmrl.errors.HarnessFailed`."""
    stops = set(work.sampling.stop_token_ids)
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    indices, tasks, seeds = _unit_episodes(env, work)
    with serve_engine(engine, work.sampling, prove=prove) as endpoint:
        played = env.run_episodes(tasks, seeds, endpoint, tokenizer_dir, work.sampling)
        proofs = [endpoint.proofs(p.trace.id) for p in played]
    samples = []
    for task_index, result, proof in zip(indices, played, proofs, strict=True):
        last = result.episode.calls()[-1].output_tokens
        ended = bool(last) and last[-1] in stops
        samples.append(
            _episode_sample(
                task_index, result.episode, "eos" if ended else "length", policy_version, proof
            )
        )
    return samples


def generate_samples(
    engine: Engine,
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    work: WorkUnit,
    policy_version: int,
    prove: Prover | None,
    tokenizer_dir: str | None = None,
) -> list[Sample]:
    """``work``'s samples in the form ``env`` asks for: completions (:func:`generate_unit`),
    episodes (:func:`generate_episodes`), or a verifiers taskset's harness episodes
    (:func:`generate_harness_episodes`, which needs ``tokenizer_dir``)."""
    if isinstance(env, VerifiersV1Env):
        if tokenizer_dir is None:
            raise ValueError("a verifiers taskset's episodes need the saved tokenizer's directory")
        return generate_harness_episodes(
            engine, env, tokenizer, tokenizer_dir, work, policy_version, prove
        )
    if isinstance(env, MultiTurnEnvironment):
        return generate_episodes(engine, env, tokenizer, work, policy_version, prove)
    return generate_unit(engine, env, tokenizer, work, policy_version, prove)


def _unit_episodes(env: Environment, work: WorkUnit) -> tuple[list[int], list[Task], list[int]]:
    """Task index, task and seed of every episode of ``work`` (G per task, in lease order;
    episode i from ``sample_seed(unit seed, i)``)."""
    indices = [t for t in work.task_indices for _ in range(work.samples_per_task)]
    tasks = [env.task("train", t) for t in indices]
    return indices, tasks, [sample_seed(work.seed, i) for i in range(len(indices))]


def _episode_sample(
    task_index: int,
    episode: Episode,
    finish: str,
    policy_version: int,
    proofs: list[dict | str | None] | None,
) -> Sample:
    """The wire form of an episode (``swarmrl.protocol.pool.Sample``'s episode form); the
    worker's reward is never sent (the trusted side scores)."""
    episode = episode.model_copy(update={"reward": None})
    calls = episode.calls()
    first = episode.segments[0]
    return Sample(
        task_index=task_index,
        prompt_tokens=first.tokens[: first.turns[0].end],
        output_tokens=[t for c in calls for t in c.output_tokens],
        logprobs=[x for c in calls for x in c.logprobs],
        finish_reason=finish,
        policy_version=policy_version,
        episode=episode,
        turn_proofs=proofs if proofs and any(p is not None for p in proofs) else None,
    )


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
