"""The built-in PyTorch inference engine: batched generation and prefill over one policy.

``TorchEngine.generate`` left-pads ragged prompts into one batch, runs one prefill and then one
decode step per output token with a key/value cache, and samples each token with the seeded
Gumbel-max rule of ``swarmrl.inference.sampling`` (so every token is replayable from its seed
and step). ``prefill`` is the validator's single pass over a fixed prompt + completion.
``load_state_dict`` swaps in a new policy version in place. A checkpoint directory carrying a
LoRA adapter (``swarmrl.inference.lora``) is loaded as its base with the adapter merged in.

Llama and Qwen2 weights run through the lean forward of ``swarmrl.inference.llama``; any other
causal LM runs through its own transformers forward (``HFBackbone``).

Knows nothing about rewards, proofs or networking: it turns token ids into token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from swarmrl.config.model import model_dir
from swarmrl.inference import llama
from swarmrl.inference.backbone import Backbone, HFBackbone
from swarmrl.inference.lora import apply_adapter, has_adapter
from swarmrl.inference.sampling import gumbel_block, sample_tokens
from swarmrl.inference.types import Generation, Prefill, check_token_ids
from swarmrl.protocol import SamplingParams

# Gumbel noise is drawn for several decode steps at once while [B, steps, vocab] stays below
# this many elements (fewer small operations per step; one step at a time for huge vocabularies).
NOISE_BLOCK_ELEMENTS = 1 << 22


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """The engine's EOS ids: the tokenizer's if given, else the model config's (maybe none)."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return {int(tokenizer.eos_token_id)}
    eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, list | tuple) else {int(eos)}


class TorchEngine:
    """Batched generation with a KV cache; one model, one device."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        self.pad_id = int(pad) if pad is not None else 0
        self.backbone: Backbone = (
            llama.LlamaBackbone(model) if llama.supports(model) else HFBackbone(model)
        )

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu"
    ) -> TorchEngine:
        """An engine over the HF checkpoint directory ``path`` (model and tokenizer files)."""
        local = model_dir(path)
        model = AutoModelForCausalLM.from_pretrained(str(local), dtype=getattr(torch, dtype))
        if has_adapter(local):
            apply_adapter(model, local)
        return cls(model, AutoTokenizer.from_pretrained(str(local)), device)

    @property
    def fast_path(self) -> bool:
        """True when the lean Llama/Qwen2 forward is in use."""
        return isinstance(self.backbone, llama.LlamaBackbone)

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy new weights (same architecture and shapes) into the model, in place."""
        result = self.model.load_state_dict(dict(state_dict), strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ()) | {"lm_head.weight"}
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"state dict does not fit the model: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
        self.backbone.reload()

    def load_checkpoint(self, path: str | Path) -> None:
        """Copy the weights of the HF checkpoint directory ``path`` in, in place.

        A single ``model.safetensors`` whose tensors are exactly the model's own (names and
        shapes; tied weights may be absent) is read straight in: building a transformers model
        per version only to copy its tensors cost ten times as much. Anything else (an
        adapter, sharded or renamed weights) goes through ``from_pretrained``.
        """
        local = Path(path)
        if not has_adapter(local) and self._load_safetensors(local / "model.safetensors"):
            return
        dtype = next(self.model.parameters()).dtype
        fresh = AutoModelForCausalLM.from_pretrained(str(local), dtype=dtype)
        if has_adapter(local):
            apply_adapter(fresh, local)
        self.load_state_dict(fresh.state_dict())

    def _load_safetensors(self, file: Path) -> bool:
        """Load ``file`` if it holds exactly the model's tensors; False (nothing loaded) if not."""
        if not file.is_file():
            return False
        own = self.model.state_dict()
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            stored = {own[n].data_ptr() for n in names & set(own)}
            absent = {n for n in set(own) - names if own[n].data_ptr() not in stored}
            if not names <= set(own) or absent:  # only a tensor tied to a stored one may lack
                return False
            if any(tuple(f.get_slice(n).get_shape()) != tuple(own[n].shape) for n in names):
                return False
            state = {n: f.get_tensor(n) for n in names}
        self.load_state_dict(state)
        return True

    def close(self) -> None:
        """Nothing to release: the engine lives in this process."""

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int],
        *,
        return_hidden: bool = False,
        ignore_eos: bool = False,
        on_step: Callable[[int, list[int], list[int]], None] | None = None,
    ) -> list[Generation]:
        """Sample one completion per prompt; ``seeds[i]`` drives the noise of prompt i.

        ``ignore_eos``: only ``params.stop_token_ids`` end a sample (every sample then runs to
        ``max_new_tokens`` unless those stop it). ``on_step(t, rows, tokens)`` is called after
        output token ``t`` is sampled, with the prompt indices still generating and the token
        each drew (a row's stop token included, then that row no more); an exception it raises
        ends the generation and propagates (a caller whose reader has gone stops it so)."""
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        vocab = self.backbone.vocab_size
        rows = [check_token_ids(p, vocab, f"prompt {i}") for i, p in enumerate(prompts)]
        if any(not r for r in rows):
            raise ValueError("every prompt needs at least one token")
        batch, width, steps = len(rows), max(len(r) for r in rows), params.max_new_tokens
        dev = self.device
        lens = torch.tensor([len(r) for r in rows], device=dev)  # [B]
        tokens = torch.full((batch, width), self.pad_id, dtype=torch.long)
        for b, r in enumerate(rows):
            tokens[b, width - len(r) :] = torch.tensor(r)
        tokens = tokens.to(dev)
        if all(len(r) == width for r in rows):
            key_valid = None  # no padding: plain causal attention
            positions = torch.arange(width, device=dev).expand(batch, width)
        else:
            key_valid = torch.ones(batch, width + steps, dtype=torch.bool, device=dev)
            key_valid[:, :width] = torch.arange(width, device=dev)[None] >= (width - lens)[:, None]
            positions = (key_valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)  # [B, width]

        cache = self.backbone.new_cache(batch, width + steps - 1)
        hidden, logits = self.backbone.forward(
            tokens, positions, None if key_valid is None else key_valid[:, :width], cache, 0, "last"
        )
        prompt_hidden = hidden.float() if return_hidden else None  # [B, width, hidden]
        decoded = (  # [B, steps - 1, hidden]: state of output token t at [:, t]
            torch.zeros(batch, steps - 1, self.backbone.hidden_size, device=dev)
            if return_hidden
            else None
        )
        stop_ids = sorted(set(params.stop_token_ids) | (set() if ignore_eos else self.eos_ids))
        stops = torch.tensor(stop_ids, dtype=torch.long, device=dev)
        out_tokens = torch.zeros(batch, steps, dtype=torch.long, device=dev)
        out_logprobs = torch.zeros(batch, steps, dtype=torch.float32, device=dev)
        # The live batch: row r of the cache and of the buffers is original row `rows_idx[r]`;
        # it shrinks when half of its rows have stopped, so finished rows stop costing compute.
        rows_idx = torch.arange(batch, device=dev)
        tok_buf, lp_buf = torch.zeros_like(out_tokens), torch.zeros_like(out_logprobs)
        seed_t = torch.tensor([int(s) for s in seeds], dtype=torch.long, device=dev)
        alive = torch.ones(batch, dtype=torch.bool, device=dev)
        noise: torch.Tensor | None = None  # [b, n, vocab]: Gumbel noise of steps noise_at ..
        noise_at = 0
        block = max(1, min(steps, NOISE_BLOCK_ELEMENTS // (batch * vocab)))
        for t in range(steps):
            step_noise = None
            if not params.greedy:
                if noise is None or t >= noise_at + noise.shape[1]:
                    noise, noise_at = gumbel_block(seed_t, t, min(block, steps - t), vocab), t
                step_noise = noise[:, t - noise_at]
            tok, lp = sample_tokens(logits, params, seed_t, t, noise=step_noise)  # [b], [b]
            tok_buf[:, t] = tok
            lp_buf[:, t] = lp
            if on_step is not None:
                on_step(t, rows_idx[alive].tolist(), tok[alive].tolist())
            alive &= ~torch.isin(tok, stops)
            n_alive = int(alive.sum())
            if t == steps - 1 or n_alive == 0:
                break
            if n_alive <= len(alive) // 2:
                gone, keep = (~alive).nonzero()[:, 0], alive.nonzero()[:, 0]
                out_tokens[rows_idx[gone]] = tok_buf[gone]
                out_logprobs[rows_idx[gone]] = lp_buf[gone]
                cache = self.backbone.select_rows(cache, keep)
                rows_idx, seed_t, lens, tok = rows_idx[keep], seed_t[keep], lens[keep], tok[keep]
                tok_buf, lp_buf, alive = tok_buf[keep], lp_buf[keep], alive[keep]
                key_valid = None if key_valid is None else key_valid[keep]
                noise = None if noise is None else noise[keep]
            hidden, logits = self.backbone.forward(
                tok[:, None], (lens + t)[:, None], key_valid, cache, width + t, "last"
            )
            if decoded is not None:
                decoded[rows_idx, t] = hidden[:, 0].float()
        out_tokens[rows_idx] = tok_buf
        out_logprobs[rows_idx] = lp_buf
        return self._results(
            rows, seeds, out_tokens, out_logprobs, set(stop_ids), prompt_hidden, decoded
        )

    def _results(
        self,
        rows: list[list[int]],
        seeds: Sequence[int],
        out_tokens: torch.Tensor,
        out_logprobs: torch.Tensor,
        stop_ids: set[int],
        prompt_hidden: torch.Tensor | None,
        decoded: torch.Tensor | None,
    ) -> list[Generation]:
        tokens_l, logprobs_l = out_tokens.cpu().tolist(), out_logprobs.cpu().tolist()
        decoded = decoded.cpu() if decoded is not None else None  # [B, steps - 1, hidden]
        width = prompt_hidden.shape[1] if prompt_hidden is not None else 0
        results = []
        for b, row in enumerate(rows):
            # A row ends at its first stop token; the buffer past it holds no live tokens.
            stop_at = next((i for i, tok in enumerate(tokens_l[b]) if tok in stop_ids), None)
            n = len(tokens_l[b]) if stop_at is None else stop_at + 1
            hidden = None
            if prompt_hidden is not None:
                parts = [prompt_hidden[b, width - len(row) :].cpu()]
                if n > 1 and decoded is not None:
                    parts.append(decoded[b, : n - 1])
                hidden = torch.cat(parts, dim=0)  # [P + n - 1, hidden]
            results.append(
                Generation(
                    prompt_tokens=row,
                    output_tokens=tokens_l[b][:n],
                    logprobs=logprobs_l[b][:n],
                    finish_reason="length" if stop_at is None else "eos",
                    seed=int(seeds[b]),
                    hidden_states=hidden,
                )
            )
        return results

    @torch.no_grad()
    def prefill(self, prompt_tokens: Sequence[int], output_tokens: Sequence[int]) -> Prefill:
        """One pass over prompt + output[:-1]: the logits behind each output token."""
        vocab = self.backbone.vocab_size
        prompt = check_token_ids(prompt_tokens, vocab, "prompt")
        output = check_token_ids(output_tokens, vocab, "output")
        if not prompt or not output:
            raise ValueError("prefill needs at least one prompt token and one output token")
        seq = prompt + output[:-1]
        tokens = torch.tensor([seq], dtype=torch.long, device=self.device)  # [1, S]
        positions = torch.arange(len(seq), device=self.device)[None]
        hidden, logits = self.backbone.forward(tokens, positions, None, None, 0, "all")
        assert logits is not None
        return Prefill(
            logits=logits[0, len(prompt) - 1 :].cpu(),  # [n, vocab]
            hidden_states=hidden[0].float().cpu(),  # [P + n - 1, hidden]
        )

    def describe(self) -> dict[str, Any]:
        """Short facts for logs: architecture, path, device, dtype."""
        return {
            "backend": "torch",
            "model_type": self.model.config.model_type,
            "fast_path": self.fast_path,
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype),
        }
