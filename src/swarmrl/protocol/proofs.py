"""Wire types of verifiable inference (DESIGN.md §5): proof bundles, assignments, verdicts.

A worker sends, per sample, its claim (tokens, log-probs, finish reason: :class:`SampleClaim`,
mirroring ``swarmrl.protocol.pool.Sample``) plus a :class:`ProofBundle`: the chunk proofs of
its final hidden states, the parameters it sampled with, and a signature binding all of it.
The validator checks both against the :class:`Assignment` the orchestrator made and returns a
:class:`ProofVerdict`. Chunk bytes are documented in ``swarmrl.toploc.encoding`` and
docs/toploc.md.

Binding digest (hex SHA-256) of a bundle, over canonical JSON (sorted keys, no spaces)::

    sha256(canonical_json({
        "scheme", "policy_version", "model_digest", "prompt_tokens", "output_tokens",
        "logprobs", "finish_reason", "sampling", "seed", "chunk_size", "topk", "chunks",
        "worker_key"}))

and ``signature`` is the worker's ed25519 signature over the 32 raw digest bytes.

On the pool's wire (``pool.Sample.proof``) a bundle travels in one of two forms, and
:func:`proof_to_wire` / :func:`proof_from_wire` are the one coding of both, used by workers,
the pool (which bounds a proof by its decoded size) and validators alike:

- ``"json"``: the bundle as a JSON object;
- ``"hex"``: the bundle's JSON text, UTF-8, as lowercase hex digits (two per byte).

Knows nothing about tensors or how proofs are computed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.protocol.sampling import FinishReason, SamplingParams

HEX64 = r"^[0-9a-f]{64}$"
HEX128 = r"^[0-9a-f]{128}$"
BASE64 = r"^[A-Za-z0-9+/]*={0,2}$"
SCHEME = "swarmrl-toploc-1"
MAX_TOKENS = 1_000_000
MAX_CHUNKS = 40_000

RejectionCode = Literal[
    "malformed",  # not a bundle: null, wrong types, truncated, oversized, non-finite values
    "assignment",  # prompt, version, model, sampling or seed differ from the assignment
    "structure",  # lengths out of limits, wrong chunk count or proof shape
    "binding",  # digest does not match the contents, or the signature does not verify
    "hidden_states",  # a chunk's committed states disagree with the replay
    "sampling",  # a token is not the seeded Gumbel-max choice of the replayed logits
    "termination",  # ends neither on a probable stop token nor exactly at the token limit
    "logprobs",  # reported log-probs differ from the replay beyond tolerance
    "reward",  # the reported reward differs from the recomputed one
    "replay",  # the validator's own replay failed or produced non-finite values
]


ProofForm = Literal["json", "hex"]  # how a bundle travels in ``pool.Sample.proof``


class ProofMessage(BaseModel):
    """Base of the messages here: unknown fields are refused, NaN and inf too."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Assignment(ProofMessage):
    """What the trusted side assigned for one sample; the validator checks claims against it.

    Example: ``{"policy_version": 3, "model_digest": "9f…(64 hex)", "prompt_tokens": [1, 7, 9],
    "sampling": {...}, "seed": 12345, "worker_key": "ab…(64 hex)"}``.
    """

    policy_version: int = Field(ge=0, lt=2**31, description="version the sample must use")
    model_digest: str = Field(pattern=HEX64, description="root digest of that version's weights")
    prompt_tokens: list[int] = Field(max_length=MAX_TOKENS, description="[P] assigned prompt")
    sampling: SamplingParams
    seed: int = Field(ge=0, lt=2**63, description="sampling seed of this sample")
    worker_key: str = Field(pattern=HEX64, description="ed25519 public key of the leaseholder")


class SampleClaim(ProofMessage):
    """What a worker reports about one sample (same fields as ``pool.Sample``).

    Shapes: ``prompt_tokens`` [P], ``output_tokens`` [n], ``logprobs`` [n]. ``reward`` is the
    worker's own score, None when it reports none (it is only ever compared, never used).
    Example: ``{"prompt_tokens": [1, 7, 9], "output_tokens": [4, 4, 2], "logprobs": [-0.1,
    -2.3, -0.5], "finish_reason": "eos", "reward": 1.0}``.
    """

    prompt_tokens: list[int] = Field(max_length=MAX_TOKENS)
    output_tokens: list[int] = Field(max_length=MAX_TOKENS)
    logprobs: list[float] = Field(max_length=MAX_TOKENS, description="nats, one per output token")
    finish_reason: FinishReason = Field(
        description="eos/stop: the last output token is a stop token; length: hit the limit"
    )
    reward: float | None = Field(None, description="worker-reported reward; None = not reported")


class ProofBundle(ProofMessage):
    """A sample's hidden-state proofs, bound to its claim and signed by the worker.

    ``chunks`` holds 1 + ceil((n - 1) / chunk_size) base64 strings of 2 + 2 * topk bytes each
    (258 for topk = 128): chunk 0 covers the prompt positions, chunk c the c-th group of
    ``chunk_size`` decode positions. Example (values shortened)::

        {"scheme": "swarmrl-toploc-1", "policy_version": 3, "model_digest": "9f…",
         "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 16,
                      "stop_token_ids": []},
         "seed": 12345, "chunk_size": 32, "topk": 128,
         "chunks": ["/9kAAQ…(344 chars)"], "worker_key": "ab…", "digest": "5c…",
         "signature": "e1…(128 hex)"}
    """

    scheme: Literal["swarmrl-toploc-1"] = Field(SCHEME, description="bundle format version")
    policy_version: int = Field(ge=0, lt=2**31, description="version the worker generated with")
    model_digest: str = Field(pattern=HEX64, description="root digest of that version's weights")
    sampling: SamplingParams
    seed: int = Field(ge=0, lt=2**63, description="sampling seed used")
    chunk_size: int = Field(gt=0, le=1_000_000, description="decode positions per chunk")
    topk: int = Field(gt=0, le=4096, description="entries committed per chunk")
    chunks: list[str] = Field(max_length=MAX_CHUNKS, description="base64 chunk encodings")
    worker_key: str = Field(pattern=HEX64, description="ed25519 public key of the prover")
    digest: str = Field(pattern=HEX64, description="SHA-256 binding digest (module docstring)")
    signature: str = Field(pattern=HEX128, description="ed25519 signature over the digest bytes")


class ChunkReport(ProofMessage):
    """Agreement of one chunk with the validator's replay (see ``swarmrl.toploc.stats``).

    Example: ``{"index": 0, "compared": 128, "exp_mismatches": 0, "mant_err_mean": 0.02,
    "mant_err_median": 0.0, "passed": true}``. The error fields are None when no exponent
    matched (the reference library reports 2^64 there).
    """

    index: int = Field(ge=0, description="chunk position in the bundle (0 = prompt)")
    compared: int = Field(ge=0, description="entries compared (top-k, fewer for tiny chunks)")
    exp_mismatches: int = Field(ge=0, description="entries whose bf16 exponents differ")
    mant_err_mean: float | None = Field(description="mean |mantissa diff|, bf16 ulps")
    mant_err_median: float | None = Field(description="median |mantissa diff|, bf16 ulps")
    passed: bool


class Rejection(ProofMessage):
    """One reason a sample failed. Example: ``{"code": "sampling", "detail": "token 5 ..."}``."""

    code: RejectionCode
    detail: str = Field(max_length=2000, description="one human-readable line")


class ProofVerdict(ProofMessage):
    """The validator's judgement of one sample.

    ``tokens_replayed`` is P + n when the replay ran (0 otherwise): the unit of credit, counted
    by the validator. ``behaviour_logprobs`` [n] are the validator's replayed log-probs of the
    output tokens under the sampling rule (the trusted behaviour policy), None if no replay.
    ``reward`` is the recomputed reward, None when no scorer was given or no replay ran.
    Example: ``{"accepted": false, "reasons": [{"code": "hidden_states", "detail": "chunk 1:
    31/128 exponents match"}], "failing_chunks": [1], "tokens_replayed": 48,
    "behaviour_logprobs": [-0.1, ...], "reward": 0.0, "chunks": [...]}``.
    """

    accepted: bool
    reasons: list[Rejection] = Field(default_factory=list)
    failing_chunks: list[int] = Field(default_factory=list, description="chunk indices")
    tokens_replayed: int = Field(0, ge=0, description="prompt + output tokens replayed")
    behaviour_logprobs: list[float] | None = Field(None, description="[n] nats")
    reward: float | None = Field(None, description="recomputed by the trusted scorer")
    chunks: list[ChunkReport] = Field(default_factory=list, description="per-chunk statistics")

    @property
    def codes(self) -> set[str]:
        """The distinct rejection codes."""
        return {r.code for r in self.reasons}


def proof_to_wire(bundle: ProofBundle, form: ProofForm = "json") -> dict[str, Any] | str:
    """``bundle`` as ``pool.Sample.proof`` carries it in ``form`` (module docstring)."""
    if form == "hex":
        return bundle.model_dump_json().encode().hex()
    return bundle.model_dump(mode="json")


def proof_from_wire(proof: dict[str, Any] | str | None) -> dict[str, Any] | bytes | None:
    """The bundle document a wire proof carries: a JSON object as is, a hex string as the JSON
    bytes it spells, None as None. Parsing and bounding those is the verifier's (one path for
    both forms, so neither form is judged by the other's rules).

    ValueError for a string that is not hex bytes (``pool.Sample`` refuses those at the edge).
    """
    if isinstance(proof, str):
        try:
            return bytes.fromhex(proof)
        except ValueError:
            raise ValueError(
                "a proof string must be hex bytes (its bundle's JSON, UTF-8)"
            ) from None
    return proof
