"""The vLLM engine: vLLM's batching and kernels with the project's seeded sampling and proofs.

``VllmEngine`` implements ``swarmrl.inference.interface.Engine`` over ``vllm.LLM``:

* ``generate`` submits every prompt as a request at vLLM temperature 0; the logits processor
  ``SeededGumbelLogits`` (``swarmrl.inference.vllm_plugin``) turns each row's logits into
  ``mask_logits(z) + g(seed, t)``, so vLLM's argmax is the seeded Gumbel-max token of
  ``swarmrl.inference.sampling``; the log-probs are those the processor recorded (of the
  declared distribution). Stop tokens: the tokenizer's EOS plus the request's own (the model's
  generation config is ignored, as in ``TorchEngine``).
* with ``return_hidden`` the final-norm hidden state of every position comes back from a hook
  inside the engine process, ordered by position. With prefix caching (``prefix_caching``, on
  by default) vLLM skips a prompt's leading blocks it still holds from an earlier request (a
  task's other samples, an episode's earlier turns); the proof's prompt chunk needs those
  positions too, so the engine keeps the hidden states of what it computed
  (``swarmrl.inference.prefix_hidden``) and fills them in, computing a prefix again, apart
  from the cache, where it no longer holds it. Both caches are cleared whenever the weights
  change.
* ``prefill`` / ``prefill_many`` run prompt + output[:-1] as requests of one token and return
  the logits the model computes from the captured hidden states; a replay computes every
  position (each request has its own cache salt), as a validator must.
* ``load_checkpoint`` reloads weights in place (``collective_rpc``), re-tying tied LM heads;
  ``load_state_dict`` does the same for in-memory weights (through a scratch file). A
  checkpoint carrying a LoRA adapter (``swarmrl.inference.lora``) is merged here, on the host,
  and its merged weights loaded through that same in-place reload (vLLM never sees the adapter).

vLLM runs its engine core in a spawned process: scripts that create an engine need an
``if __name__ == "__main__":`` guard. ``close`` stops that process.

Knows nothing about rewards, proofs or networking.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from swarmrl.config.inference import VllmConfig
from swarmrl.config.model import model_dir
from swarmrl.errors import EngineUnavailable
from swarmrl.inference.interface import VLLM_INSTALL_HINT, vllm_available
from swarmrl.inference.lora import apply_adapter, has_adapter
from swarmrl.inference.prefix_hidden import HiddenPrefixes
from swarmrl.inference.types import Generation, Prefill, check_token_ids
from swarmrl.protocol import SamplingParams

_PLUGIN = "swarmrl.inference.vllm_plugin"
# Keys of ``vllm.SamplingParams.extra_args`` read inside the engine process (vllm_plugin).
KEY = "swarmrl_key"  # str: identifies the request's records
SEED = "swarmrl_seed"  # int sampling seed; absent = the logits are left alone
RULE = "swarmrl_rule"  # [temperature, top_k, top_p] of the declared distribution
HIDDEN = "swarmrl_hidden"  # True = keep final-norm hidden states
_FINISH = {"stop": "eos", "length": "length"}


def _environment(config: VllmConfig) -> None:
    """Process environment vLLM reads at start (only where the caller has not set it)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kv_cache_gib))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _unpack(data: bytes, shape: list[int]) -> torch.Tensor:
    """The float32 tensor ``vllm_plugin._pack`` sent."""
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)


class VllmEngine:
    """One policy in a running vLLM engine (see the module docstring)."""

    def __init__(
        self,
        path: str | Path,
        config: VllmConfig | None = None,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        remove_on_close: bool = False,
    ) -> None:
        """``remove_on_close``: ``path`` is a scratch copy this engine owns (deleted by close)."""
        if not vllm_available():
            raise EngineUnavailable(f"vLLM is not installed: {VLLM_INSTALL_HINT}")
        local = model_dir(path)
        self.config = config or VllmConfig()
        self.path = local
        self._scratch_dir: Path | None = None
        self._remove = [local] if remove_on_close else []
        self.dtype = dtype
        self.device = torch.device(device)
        _environment(self.config)
        from vllm import LLM

        try:
            self.llm = LLM(
                model=str(local),
                dtype=dtype,
                enforce_eager=self.config.enforce_eager,
                max_model_len=self.config.max_model_len,
                max_num_seqs=self.config.max_num_seqs,
                gpu_memory_utilization=self.config.gpu_memory_utilization,
                enable_prefix_caching=self.config.prefix_caching,
                **({"block_size": self.config.block_size} if self.config.block_size else {}),
                async_scheduling=False,
                generation_config="vllm",
                seed=0,
                logits_processors=[f"{_PLUGIN}:SeededGumbelLogits"],
                worker_extension_cls=f"{_PLUGIN}.SwarmrlWorkerExtension",
            )
        except Exception as exc:  # recovery intended: any load failure becomes one clear line
            model_type = json.loads((local / "config.json").read_text()).get("model_type")
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise EngineUnavailable(
                f"vLLM cannot load {local} (model_type {model_type!r}): {first}"
            ) from exc
        try:
            self.hidden_size = int(self.llm.collective_rpc("swarmrl_install")[0])
        except Exception as exc:  # recovery intended: unsupported layout, engine stopped
            self.close()
            raise EngineUnavailable(f"vLLM engine for {local}: {exc}") from exc
        tokenizer = self.llm.get_tokenizer()
        self.tokenizer = tokenizer
        self.eos_ids: set[int] = (
            {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        )
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        block = int(self.llm.llm_engine.vllm_config.cache_config.block_size)
        self._prefixes = HiddenPrefixes(block, int(self.config.prefix_hidden_gib * 2**30))
        self.cached_positions = 0  # prompt positions generate took from the prefix cache
        if has_adapter(local):
            self._load_merged(local)

    # -- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int],
        *,
        return_hidden: bool = False,
    ) -> list[Generation]:
        """One completion per prompt; ``seeds[i]`` drives the noise of prompt i."""
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        rows = [check_token_ids(p, self.vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]
        if any(not r for r in rows):
            raise ValueError("every prompt needs at least one token")
        longest = max(len(r) for r in rows) + params.max_new_tokens
        if longest > self.max_model_len:
            raise ValueError(
                f"prompt + max_new_tokens = {longest} tokens exceeds the engine's "
                f"max_model_len = {self.max_model_len} (inference.vllm.max_model_len)"
            )
        from vllm import SamplingParams as VllmParams

        stops = sorted(self.eos_ids | set(params.stop_token_ids))
        tag = uuid.uuid4().hex
        keys = [f"{tag}-{i}" for i in range(len(rows))]
        rule = [params.temperature, params.top_k, params.top_p]
        requests = [
            VllmParams(
                temperature=0.0,
                max_tokens=params.max_new_tokens,
                stop_token_ids=stops,
                ignore_eos=True,  # EOS is among `stops`; one stop rule for every backend
                detokenize=False,
                extra_args={KEY: k, SEED: int(s), RULE: rule, HIDDEN: return_hidden},
            )
            for k, s in zip(keys, seeds, strict=True)
        ]
        outputs = self._run(rows, requests)
        records = self._take(keys)
        results = []
        for row, seed, out, rec in zip(rows, seeds, outputs, records, strict=True):
            completion = out.outputs[0]
            tokens = [int(t) for t in completion.token_ids]
            if len(rec["logprobs"]) != len(tokens):
                raise RuntimeError(
                    f"sampler recorded {len(rec['logprobs'])} log-probs for {len(tokens)} tokens"
                )
            results.append(
                Generation(
                    prompt_tokens=row,
                    output_tokens=tokens,
                    logprobs=rec["logprobs"],
                    finish_reason=_FINISH.get(completion.finish_reason, "length"),  # type: ignore[arg-type]
                    seed=int(seed),
                )
            )
        if return_hidden:
            seqs = [g.prompt_tokens + g.output_tokens for g in results]
            for gen, states in zip(results, self._whole_hidden(seqs, records), strict=True):
                gen.hidden_states = states
        return results

    def _whole_hidden(self, seqs: list[list[int]], records: list[dict[str, Any]]) -> list[Any]:
        """Each sequence's hidden states of positions ``[0, len - 1)`` (the last token never
        ran): the captured rows, after the rows of a cached prefix (module docstring)."""
        out: list[Any] = [None] * len(seqs)
        lost: list[int] = []  # a cached prefix this engine no longer holds the rows of
        for i in sorted(range(len(seqs)), key=lambda i: records[i]["start"]):
            rec, seq = records[i], seqs[i]
            if rec["hidden"] is None:
                raise RuntimeError(
                    "vLLM ran without the hidden-state hook (CUDA graphs replay without "
                    "it): set inference.vllm.enforce_eager = true for proofs"
                )
            head = self._prefixes.find(seq, rec["start"]) if rec["start"] else None
            if rec["start"] and head is None:
                lost.append(i)
                continue
            rows = rec["hidden"] if head is None else torch.cat([head, rec["hidden"]])
            out[i] = self._keep(seq, rows)
        if lost:
            heads = self._computed_apart([seqs[i][: records[i]["start"]] for i in lost])
            for i, head in zip(lost, heads, strict=True):
                out[i] = self._keep(seqs[i], torch.cat([head, records[i]["hidden"]]))
        self.cached_positions += sum(rec["start"] for rec in records)
        return out

    def _keep(self, seq: list[int], hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[: len(seq) - 1]
        if self.config.prefix_caching:
            self._prefixes.add(seq, hidden)
        return hidden

    def _computed_apart(self, prefixes: list[list[int]]) -> list[torch.Tensor]:
        """Hidden states of every position of each prefix, computed apart from the cache."""
        records = self._computed(prefixes)
        return [rec["hidden"][: len(p)] for rec, p in zip(records, prefixes, strict=True)]

    def _computed(
        self, seqs: list[list[int]], logits_from: list[int] | None = None
    ) -> list[dict[str, Any]]:
        """Records (``swarmrl_take``) of one-token requests computing every position of each
        sequence, none reused from the prefix cache (a cache salt each)."""
        from vllm import SamplingParams as VllmParams

        tag = uuid.uuid4().hex
        keys = [f"{tag}-{i}" for i in range(len(seqs))]
        requests = [
            VllmParams(
                temperature=0.0, max_tokens=1, detokenize=False, extra_args={KEY: k, HIDDEN: True}
            )
            for k in keys
        ]
        self._run(seqs, requests, salted=True)
        return self._take(keys, logits_from)

    def _run(self, rows: list[list[int]], requests: list[Any], salted: bool = False) -> list[Any]:
        """``salted``: every request computes all its positions (a cache salt of its own)."""
        from vllm.inputs import TokensPrompt

        prompts = [
            TokensPrompt(prompt_token_ids=r, cache_salt=uuid.uuid4().hex)
            if salted and self.config.prefix_caching
            else TokensPrompt(prompt_token_ids=r)
            for r in rows
        ]
        try:
            return self.llm.generate(prompts, requests, use_tqdm=False)
        except BaseException:
            self.llm.collective_rpc("swarmrl_forget")
            raise

    def _take(self, keys: list[str], logits_from: list[int] | None = None) -> list[dict[str, Any]]:
        records = self.llm.collective_rpc("swarmrl_take", args=(keys, logits_from))[0]
        for rec in records:
            for name in ("hidden", "logits"):
                if rec[name] is not None:
                    rec[name] = _unpack(*rec[name])
        return records

    # -- replay -----------------------------------------------------------------------------

    def prefill(self, prompt_tokens: Sequence[int], output_tokens: Sequence[int]) -> Prefill:
        """One pass over prompt + output[:-1]: the logits behind each output token."""
        return self.prefill_many([(prompt_tokens, output_tokens)])[0]

    def prefill_many(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[Prefill]:
        """``prefill`` of many (prompt, output) pairs, batched by vLLM's scheduler."""
        if not pairs:
            return []

        seqs, starts = [], []
        for i, (prompt_tokens, output_tokens) in enumerate(pairs):
            prompt = check_token_ids(prompt_tokens, self.vocab_size, f"prompt {i}")
            output = check_token_ids(output_tokens, self.vocab_size, f"output {i}")
            if not prompt or not output:
                raise ValueError("prefill needs at least one prompt token and one output token")
            if len(prompt) + len(output) > self.max_model_len:
                raise ValueError(
                    f"prompt + output of pair {i} exceeds inference.vllm.max_model_len"
                )
            seqs.append(prompt + output[:-1])
            starts.append(len(prompt) - 1)
        records = self._computed(seqs, starts)
        return [
            Prefill(logits=rec["logits"], hidden_states=rec["hidden"][: len(seq)])
            for rec, seq in zip(records, seqs, strict=True)
        ]

    # -- weights and lifecycle --------------------------------------------------------------

    def load_checkpoint(self, path: str | Path) -> None:
        """Reload the weights from the HF checkpoint directory ``path``, in place."""
        local = model_dir(path)
        if has_adapter(local):
            self._load_merged(local)
        else:
            self._reload(str(local))
        self.path = local

    def _reload(self, path: str) -> None:
        """Load the weights in ``path`` in place; what was computed with the old ones goes."""
        self.llm.collective_rpc("swarmrl_reload", args=(path,))
        if self.config.prefix_caching:
            self._prefixes.clear()
            if not self.llm.reset_prefix_cache():  # False: vLLM kept blocks of the old weights
                raise RuntimeError("vLLM could not clear its prefix cache after a weight load")

    def _load_merged(self, path: Path) -> None:
        """Load ``path``'s base with its LoRA adapter merged in, through ``load_state_dict``."""
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, self.dtype))
        apply_adapter(base, path)
        self.load_state_dict(base.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load in-memory weights (an HF state dict of the same model), in place.

        Written as one safetensors file next to the current config in a scratch directory of
        this engine, then reloaded like a checkpoint: vLLM's reload reads weights from disk.
        """
        from safetensors.torch import save_file

        scratch = self._scratch()
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
        save_file(tensors, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        self._reload(str(scratch))

    def _scratch(self) -> Path:
        """A private directory holding the served model's config (weights written per load)."""
        if self._scratch_dir is None:
            self._scratch_dir = Path(tempfile.mkdtemp(prefix="swarmrl-vllm-"))
        for name in ("config.json", "generation_config.json"):
            if (self.path / name).is_file() and self.path != self._scratch_dir:
                shutil.copyfile(self.path / name, self._scratch_dir / name)
        return self._scratch_dir

    def describe(self) -> dict[str, Any]:
        """Short facts for logs: backend, architecture, device, dtype."""
        import vllm

        return {
            "backend": f"vllm {vllm.__version__}",
            "model_type": self.llm.llm_engine.model_config.hf_config.model_type,
            "device": str(self.device),
            "dtype": self.dtype,
        }

    def close(self) -> None:
        """Stop vLLM's engine process (idempotent)."""
        if self._scratch_dir is not None:
            self._remove.append(self._scratch_dir)
            self._scratch_dir = None
        for directory in self._remove:
            shutil.rmtree(directory, ignore_errors=True)
        self._remove = []
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
