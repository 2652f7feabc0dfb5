"""Proof bundles on the worker side: chunk proofs of a batch of generations, bound and signed.

``build_bundles`` turns the engine's ``Generation`` objects (with hidden states) into one
signed :class:`~swarmrl.protocol.proofs.ProofBundle` per sample; all chunks of all samples are
ranked and interpolated in one batched pass. ``binding_digest`` is shared with the verifier so
both sides hash exactly the same fields (listed in ``swarmrl.protocol.proofs``).

Knows nothing about transport, leases or how a validator judges a bundle.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence

from swarmrl.identity import KeyPair, canonical_json
from swarmrl.inference.types import Generation
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.proofs import SCHEME, ProofBundle, SampleClaim
from swarmrl.toploc.encoding import build_chunk_proofs


def binding_digest(bundle: ProofBundle, claim: SampleClaim) -> str:
    """Hex SHA-256 over the bound fields of a bundle and its sample's claim."""
    payload = {
        "scheme": bundle.scheme,
        "policy_version": bundle.policy_version,
        "model_digest": bundle.model_digest,
        "prompt_tokens": claim.prompt_tokens,
        "output_tokens": claim.output_tokens,
        "logprobs": claim.logprobs,
        "finish_reason": claim.finish_reason,
        "sampling": bundle.sampling.model_dump(mode="json"),  # lists, as on the wire
        "seed": bundle.seed,
        "chunk_size": bundle.chunk_size,
        "topk": bundle.topk,
        "chunks": bundle.chunks,
        "worker_key": bundle.worker_key,
    }
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def seal(bundle: ProofBundle, claim: SampleClaim, keypair: KeyPair) -> ProofBundle:
    """A copy of ``bundle`` with ``worker_key``, ``digest`` and ``signature`` set by ``keypair``."""
    unsigned = bundle.model_copy(update={"worker_key": keypair.public_key_hex})
    digest = binding_digest(unsigned, claim)
    signature = keypair.sign(bytes.fromhex(digest))
    return unsigned.model_copy(update={"digest": digest, "signature": signature})


def claim_of(generation: Generation, reward: float | None = None) -> SampleClaim:
    """The claim a worker reports for one generation."""
    return SampleClaim(
        prompt_tokens=list(generation.prompt_tokens),
        output_tokens=list(generation.output_tokens),
        logprobs=[float(x) for x in generation.logprobs],
        finish_reason=generation.finish_reason,
        reward=reward,
    )


def build_bundles(
    generations: Sequence[Generation],
    *,
    keypair: KeyPair,
    policy_version: int,
    model_digest: str,
    params: SamplingParams,
    chunk_size: int = 32,
    topk: int = 128,
) -> list[ProofBundle]:
    """One signed bundle per generation; each needs ``hidden_states`` ([P + n - 1, hidden]).

    Raises ValueError when a generation carries no hidden states (generate with
    ``return_hidden=True``).
    """
    missing = [i for i, g in enumerate(generations) if g.hidden_states is None]
    if missing:
        raise ValueError(f"generations {missing[:5]} have no hidden states to prove")
    proofs = build_chunk_proofs(
        [g.hidden_states for g in generations],  # type: ignore[misc]
        [len(g.prompt_tokens) for g in generations],
        chunk_size,
        topk,
    )
    bundles = []
    for generation, chunks in zip(generations, proofs, strict=True):
        draft = ProofBundle(
            policy_version=policy_version,
            model_digest=model_digest,
            sampling=params,
            seed=generation.seed,
            chunk_size=chunk_size,
            topk=topk,
            chunks=[base64.b64encode(c).decode() for c in chunks],
            worker_key="0" * 64,
            digest="0" * 64,
            signature="0" * 128,
        )
        bundles.append(seal(draft, claim_of(generation), keypair))
    return bundles


__all__ = [
    "SCHEME",
    "binding_digest",
    "build_bundles",
    "claim_of",
    "seal",
]
