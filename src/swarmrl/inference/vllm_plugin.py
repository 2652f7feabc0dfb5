"""The parts of the vLLM engine that run inside vLLM's engine process.

vLLM runs the model in its own process; ``VllmEngine`` (``swarmrl.inference.vllm_engine``)
hands it the two classes below by import path:

* ``SeededGumbelLogits`` — a V1 logits processor. For every request that carries a sampling
  seed in ``SamplingParams.extra_args`` it replaces the row's logits with
  ``mask_logits(z, params) + g(seed, t)`` (``swarmrl.inference.sampling``; ``t`` = output tokens
  so far), so vLLM's own greedy argmax (the request runs at temperature 0) picks exactly the
  seeded Gumbel-max token. It records ``log_softmax(mask_logits(z))`` at that token: the log-prob
  of the declared distribution, not of the noised one.
* ``SwarmrlWorkerExtension`` — methods added to vLLM's worker, called through
  ``LLM.collective_rpc``: install a forward hook on the decoder's final norm that keeps, for
  each request asking for it, the final-norm hidden state at every position the engine computes
  (mapped to requests through the model runner's own batch layout, so continuous batching and
  chunked prefill place every row correctly); hand over and forget what a finished request
  recorded (hidden states, log-probs, logits for a prefill); reload weights in place.

Both share ``_RECORDS``, a per-process table keyed by the ``swarmrl_key`` each request carries.

Knows nothing about proofs, rewards or the caller's process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from swarmrl.inference.sampling import gumbel_noise, mask_logits
from swarmrl.inference.vllm_engine import HIDDEN, KEY, RULE, SEED
from swarmrl.protocol import SamplingParams


@dataclass
class _Record:
    """What one request left behind: per-position hidden rows, per-step log-probs."""

    positions: list[torch.Tensor] = field(default_factory=list)  # int64 [rows] each
    hidden: list[torch.Tensor] = field(default_factory=list)  # [rows, hidden] model dtype
    logprobs: dict[int, float] = field(default_factory=dict)  # decode step -> log-prob


_RECORDS: dict[str, _Record] = {}


def _record(key: str) -> _Record:
    rec = _RECORDS.get(key)
    if rec is None:
        rec = _RECORDS[key] = _Record()
    return rec


@dataclass
class _Row:
    key: str
    seed: int
    params: SamplingParams
    output: list[int]  # vLLM's live list of this request's output tokens


@dataclass
class _Group:
    """Seeded rows sharing one declared distribution, with their tensors built once."""

    params: SamplingParams
    rows: list[_Row]
    at: torch.Tensor | slice  # batch indices (a slice when they are contiguous)
    seeds: torch.Tensor  # int64 [rows] on the logits' device


class SeededGumbelLogits(LogitsProcessor):
    """Seeded Gumbel-max sampling as a vLLM V1 logits processor (see the module docstring).

    Per step the work is: one gather of the group's rows (a view when they are contiguous),
    ``mask_logits``, the noise for (seed, step) computed on the logits' own device, an argmax,
    the chosen token's log-prob, and one write back. The grouping of rows by distribution and
    the seed tensors are rebuilt only when the batch changes.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Row] = {}  # batch index -> request
        self.device = torch.device(device)
        self._groups: list[_Group] | None = None  # None = rebuild at the next apply
        self._batch = 0  # the logits' batch size the groups were built for

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        args = sampling_params.extra_args or {}
        if SEED in args and sampling_params.temperature != 0.0:
            raise ValueError("seeded requests must run at vLLM temperature 0 (argmax)")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self._groups = None
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output in batch_update.added:
            args = params.extra_args or {}
            if SEED in args:
                temperature, top_k, top_p = args[RULE]
                rule = SamplingParams(
                    temperature=float(temperature), top_k=int(top_k), top_p=float(top_p)
                )
                self.rows[index] = _Row(str(args[KEY]), int(args[SEED]), rule, output)
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = row_b

    def _grouped(self, batch: int, device: torch.device) -> list[_Group]:
        """The seeded rows below ``batch``, grouped by distribution (cached per batch)."""
        if self._groups is None or self._batch != batch:
            members: dict[SamplingParams, list[int]] = {}
            for index in sorted(i for i in self.rows if i < batch):
                members.setdefault(self.rows[index].params, []).append(index)
            self._groups, self._batch = [], batch
            for params, indices in members.items():
                rows = [self.rows[i] for i in indices]
                contiguous = indices == list(range(indices[0], indices[-1] + 1))
                at = (
                    slice(indices[0], indices[-1] + 1)
                    if contiguous
                    else torch.tensor(indices, device=device)
                )
                seeds = torch.tensor([r.seed for r in rows], dtype=torch.int64, device=device)
                self._groups.append(_Group(params, rows, at, seeds))
        return self._groups

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [batch, vocab] float32; seeded rows become masked + noise."""
        if not self.rows:
            return logits
        for group in self._grouped(logits.shape[0], logits.device):
            masked = mask_logits(logits[group.at], group.params)  # [b, vocab]
            steps = [len(r.output) for r in group.rows]
            if group.params.greedy:
                scores = masked
            else:
                step_t = torch.tensor(steps, dtype=torch.int64).to(logits.device)
                noise = gumbel_noise(group.seeds, step_t, masked.shape[-1])  # [b, vocab]
                scores = noise.add_(masked)
            tokens = torch.argmax(scores, dim=-1)  # what vLLM's argmax will pick
            lps = torch.log_softmax(masked, dim=-1).gather(-1, tokens[:, None])[:, 0]
            for row, step, lp in zip(group.rows, steps, lps.tolist(), strict=True):
                _record(row.key).logprobs[step] = lp
            logits[group.at] = scores
        return logits


class SwarmrlWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self`` is the worker."""

    model_runner: Any

    def swarmrl_install(self) -> int:
        """Hook the final norm's output; returns the hidden size."""
        model = self.model_runner.get_model()
        decoder = getattr(model, "model", None)
        if decoder is None or not hasattr(decoder, "norm"):
            raise TypeError(f"{type(model).__name__} has no decoder with a final norm")
        # The decoder's own __call__ is replaced by vLLM's compile wrapper (no module hooks);
        # its final norm is a plain module, called once per forward on every computed token.
        if not getattr(decoder, "_swarmrl_hooked", False):
            decoder.norm.register_forward_hook(self._swarmrl_capture)
            decoder._swarmrl_hooked = True
        return int(model.config.hidden_size)

    def _swarmrl_capture(self, module: Any, args: tuple, output: Any) -> None:
        runner = self.model_runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        if num_reqs == 0:
            return
        keys = [self._swarmrl_key(req_id) for req_id in batch.req_ids[:num_reqs]]
        if not any(keys):
            return
        hidden = output[0] if isinstance(output, tuple) else output  # [tokens, hidden]
        starts = runner.query_start_loc.np[: num_reqs + 1].tolist()
        # one copy per step (the engine may reuse its buffers), left on the model's device:
        # no host transfer or sync inside the decode loop
        kept = hidden[: starts[-1]].detach().clone()
        pos = runner.positions[: starts[-1]].detach().clone()
        for i, key in enumerate(keys):
            if key:
                rec = _record(key)
                rec.positions.append(pos[starts[i] : starts[i + 1]])
                rec.hidden.append(kept[starts[i] : starts[i + 1]])

    def _swarmrl_key(self, req_id: str) -> str | None:
        """The record key of a request that asked for hidden states, else None (memoised)."""
        wants: dict[str, str | None] = self.__dict__.setdefault("_swarmrl_wants", {})
        if req_id not in wants:
            state = self.model_runner.requests.get(req_id)
            args = (state.sampling_params.extra_args or {}) if state is not None else {}
            wants[req_id] = str(args[KEY]) if args.get(HIDDEN) else None
        return wants[req_id]

    def swarmrl_take(
        self, keys: Sequence[str], logits_from: Sequence[int] | None = None
    ) -> list[dict[str, Any]]:
        """Per key: ``hidden`` [positions, hidden] ordered by position from ``start`` (None if
        not kept; ``start`` > 0 where the leading positions came from the prefix cache and were
        not computed), ``logprobs`` per decode step, and with ``logits_from[i] = s`` the
        ``logits`` [rows - s, vocab] the model computes from hidden rows s.. (tensors as
        ``_pack`` makes them). Forgets the keys.
        """
        model = self.model_runner.get_model()
        self.__dict__.pop("_swarmrl_wants", None)  # finished requests are not seen again
        out = []
        for i, key in enumerate(keys):
            rec = _RECORDS.pop(key, _Record())
            item: dict[str, Any] = {
                "logprobs": [rec.logprobs[s] for s in sorted(rec.logprobs)],
                "hidden": None,
                "start": 0,
                "logits": None,
            }
            if rec.hidden:
                pos = torch.cat(rec.positions).to("cpu", torch.int64)
                rows = torch.cat(rec.hidden)
                start = int(pos.min())  # positions before it were cached, not computed
                order = torch.full((int(pos.max()) + 1 - start,), -1, dtype=torch.int64)
                order[pos - start] = torch.arange(len(pos))  # a recomputed one keeps its last row
                if bool((order < 0).any()):
                    raise RuntimeError(f"request {key}: positions missing from the capture")
                states = rows[order.to(rows.device)]
                item["hidden"] = _pack(states)
                item["start"] = start
                if logits_from is not None:
                    if logits_from[i] < start:
                        raise RuntimeError(f"request {key}: logits asked of cached positions")
                    with torch.no_grad():
                        first = logits_from[i] - start
                        item["logits"] = _pack(model.compute_logits(states[first:]))
            out.append(item)
        return out

    def swarmrl_forget(self) -> int:
        """Drop every record (after a failed call); returns how many there were."""
        n = len(_RECORDS)
        _RECORDS.clear()
        self.__dict__.pop("_swarmrl_wants", None)
        return n

    def swarmrl_reload(self, path: str) -> None:
        """Load the checkpoint directory ``path`` in place; re-tie a tied LM head.

        vLLM's in-place reload refreshes the input embedding of a model with tied embeddings
        but not the (separately packed) LM head; here the head is rebuilt from the embedding.
        """
        runner = self.model_runner
        runner.reload_weights(weights_path=path)
        model = runner.get_model()
        if getattr(model.config, "tie_word_embeddings", False):
            _retie_head(model)


def _pack(x: torch.Tensor) -> tuple[bytes, list[int]]:
    """A tensor as float32 bytes and its shape (RPC results travel as msgpack)."""
    return x.detach().float().cpu().contiguous().numpy().tobytes(), list(x.shape)


def _retie_head(model: Any) -> None:
    head, embed = model.lm_head, model.model.embed_tokens
    with torch.no_grad():
        if head.weight.shape == embed.weight.shape:
            head.weight.copy_(embed.weight)
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
