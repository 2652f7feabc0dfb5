"""Delta size / full size of the shardcast benchmark (part 4).

One AdamW (lr 3e-4) step of the tiny demo model on a real next-token loss, and simulated
small-learning-rate AdamW steps of a ~100M-parameter model whose published weights are bf16.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher


def delta_tiny_model(work: Path, key: KeyPair) -> dict:
    import torch
    from safetensors.torch import save_file

    from swarmrl.config.model import TinyModelConfig
    from swarmrl.model.factory import create_tiny_model
    from swarmrl.model.io import save_policy
    from swarmrl.model.tokenizer import build_char_tokenizer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("0123456789+=\n ")
    model = create_tiny_model(TinyModelConfig(), tokenizer)
    save_policy(model, tokenizer, work / "tiny0")
    text = [
        f"{a}+{b}={str(a + b)[::-1]}" for a, b in [(123, 456), (305, 271), (111, 222), (400, 499)]
    ]
    ids = torch.tensor([tokenizer(t)["input_ids"] for t in text])  # [4, seq]
    bf16_before = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=3e-4).step()
    save_policy(model, tokenizer, work / "tiny1")
    bf16_after = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())
    out = {"params": params, "loss_before_step": float(loss.detach())}
    for dtype, dirs in (
        ("float32", ("tiny0", "tiny1")),
        ("bfloat16", ("tiny0_bf16", "tiny1_bf16")),
    ):
        if dtype == "bfloat16":  # the same step, published as bf16 weights
            for name, state in zip(dirs, (bf16_before, bf16_after), strict=True):
                (work / name).mkdir()
                shutil.copy(work / "tiny0" / "config.json", work / name / "config.json")
                save_file(state, str(work / name / "model.safetensors"))
        pub = Publisher(work / f"tiny_store_{dtype}", key)
        pub.publish(work / dirs[0], 1)
        m = pub.publish(work / dirs[1], 2)
        delta = sum(d.size for d in m.deltas)
        out[dtype] = {
            "full_bytes": m.total_bytes,
            "delta_bytes": delta,
            "fraction": delta / m.total_bytes,
        }
    return out


def delta_100m_bf16(work: Path, key: KeyPair, lrs: list[float]) -> list[dict]:
    """Simulated AdamW steps on a 100M-parameter model whose published weights are bf16."""
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    shapes = [(4096, 4096)] * 5 + [(32000, 512)] * 1 + [(1024, 1024)] * 4  # ~104M params
    results = []
    for lr in lrs:
        params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)

        def step(params: list = params, opt: torch.optim.Optimizer = opt) -> None:
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()

        for _ in range(3):  # warm optimizer state: not the first (sign-like) step
            step()

        def dump(name: str, params: list = params) -> Path:
            d = work / name
            d.mkdir(exist_ok=True)
            save_file(
                {f"w{i}": p.detach().to(torch.bfloat16).contiguous() for i, p in enumerate(params)},
                str(d / "model.safetensors"),
            )
            (d / "config.json").write_text('{"model_type": "simulated"}')
            return d

        before = dump(f"big_lr{lr}_a")
        old_bf16 = [p.detach().to(torch.bfloat16) for p in params]
        step()
        after = dump(f"big_lr{lr}_b")
        changed = sum(
            int((p.detach().to(torch.bfloat16) != o).sum())
            for p, o in zip(params, old_bf16, strict=True)
        )
        del old_bf16
        pub = Publisher(work / f"big_store_{lr}", key)
        pub.publish(before, 1)
        started = time.perf_counter()
        m = pub.publish(after, 2)
        publish_s = time.perf_counter() - started
        delta = sum(d.size for d in m.deltas)
        n = sum(p.numel() for p in params)
        results.append(
            {
                "params": n,
                "lr": lr,
                "full_bytes": m.total_bytes,
                "delta_bytes": delta,
                "fraction": delta / m.total_bytes,
                "publish_with_delta_s": publish_s,
                "bf16_values_changed": changed / n,
            }
        )
        shutil.rmtree(work / f"big_store_{lr}")
        shutil.rmtree(before)
        shutil.rmtree(after)
        del params, opt
    return results
