"""Benchmark: TorchEngine.generate against transformers' generate on the same model.

Same batch, prompts and sampling settings (T = 1, no top-k/top-p, a fixed number of new tokens
with EOS disabled so both decode exactly ``batch * new_tokens`` tokens), repetitions of the two
interleaved in one process so machine load hits both alike. Reports tokens/s of each
(median and best over repetitions; on a shared machine the best is the least disturbed run)
and the ratios engine / transformers, on the wall clock or (``--clock cpu``) on this
process's CPU time, which other load on the machine barely moves when ``--threads 1``.

    python bench/generate.py                       # tiny model and a ~100M-parameter Llama
    python bench/generate.py --models tiny --reps 5 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from swarmrl.config.model import TinyModelConfig
from swarmrl.inference import TorchEngine
from swarmrl.model import build_char_tokenizer, create_tiny_model
from swarmrl.protocol import SamplingParams

ALPHABET = "0123456789+-*=() abcdefghijklmnopqrstuvwxyz\n"
WHO = ("transformers", "engine")


def build_model(name: str, vocab: int) -> PreTrainedModel:
    """A random-init model: 'tiny' (TinyModelConfig), 'tiny-qwen2', or 'llama-100m'."""
    tok = build_char_tokenizer(ALPHABET)
    torch.manual_seed(0)
    if name == "tiny":
        return create_tiny_model(TinyModelConfig(), tok)
    if name == "tiny-qwen2":
        return create_tiny_model(TinyModelConfig(arch="qwen2"), tok)
    shape = dict(
        vocab_size=vocab or len(tok),
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=3072,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    if name == "llama-100m":
        return LlamaForCausalLM(LlamaConfig(**shape)).eval()
    if name == "qwen2-100m":
        return Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    raise SystemExit(f"unknown model {name!r}")


def make_prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    """Ragged prompts of 8..12 tokens starting with <bos> (id 1), ids drawn from the vocab."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 13, (batch,), generator=g).tolist()
    return [[1, *torch.randint(4, vocab, (n - 1,), generator=g).tolist()] for n in lengths]


def hf_runner(model: PreTrainedModel, prompts: list[list[int]], new: int) -> Callable[[], int]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run() -> int:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            eos_token_id=None,
            pad_token_id=0,
        )
        return int((out.shape[1] - width) * out.shape[0])

    return run


def engine_runner(model: PreTrainedModel, prompts: list[list[int]], new: int) -> Callable[[], int]:
    engine = TorchEngine(model, None)
    engine.eos_ids = set()  # decode exactly `new` tokens, like min_new_tokens on the HF side
    params = SamplingParams(temperature=1.0, max_new_tokens=new)
    seeds = list(range(len(prompts)))

    def run() -> int:
        return sum(len(g.output_tokens) for g in engine.generate(prompts, params, seeds))

    return run


def measure(run: Callable[[], int], clock: Callable[[], float]) -> float:
    """Tokens per second of one run, on ``clock`` (wall clock or this process's CPU time)."""
    start = clock()
    with torch.no_grad():
        tokens = run()
    return tokens / (clock() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,llama-100m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=0, help="vocab of the 100M models (0 = char)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time (with --threads 1, insensitive to other load)",
    )
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(args.threads)
    console = Console(width=160)
    table = Table(
        title=f"generate: batch {args.batch}, {args.new_tokens} new tokens, T=1, "
        f"tokens per {args.clock}-clock second"
    )
    columns = ("model", "params", "fast path")
    for col in (
        *columns,
        *(f"{w} {s}" for s in ("median", "best") for w in WHO),
        "ratio",
        "best ratio",
    ):
        table.add_column(col, justify="right")
    rows = []
    for name in args.models.split(","):
        model = build_model(name, args.vocab)
        n_params = sum(p.numel() for p in model.parameters()) / 1e6
        prompts = make_prompts(args.batch, model.config.vocab_size, seed=0)
        hf, eng = (
            hf_runner(model, prompts, args.new_tokens),
            engine_runner(model, prompts, args.new_tokens),
        )
        fast = TorchEngine(model, None).fast_path
        hf(), eng()  # warm-up
        hf_rates, eng_rates = [], []
        for _ in range(args.reps):
            hf_rates.append(measure(hf, clock))
            eng_rates.append(measure(eng, clock))
        hf_med, eng_med = (statistics.median(rs) for rs in (hf_rates, eng_rates))
        hf_best, eng_best = (max(rs) for rs in (hf_rates, eng_rates))
        row = (
            name,
            f"{n_params:.1f}M",
            str(fast),
            f"{hf_med:.0f}",
            f"{eng_med:.0f}",
            f"{hf_best:.0f}",
            f"{eng_best:.0f}",
            f"{eng_med / hf_med:.2f}x",
            f"{eng_best / hf_best:.2f}x",
        )
        rows.append(row)
        table.add_row(*row)
        walls = [[round(r) for r in rs] for rs in (hf_rates, eng_rates)]
        console.print(f"{name} tok/s per rep: transformers {walls[0]}  engine {walls[1]}")
    console.print(table)
    print("| " + " | ".join(str(c.header) for c in table.columns) + " |")
    print("|" + "---|" * len(table.columns))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
