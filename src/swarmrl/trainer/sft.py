"""Supervised warm start: teach the tiny model the task's format from worked examples.

The examples are a small fixed set of training-split tasks; a share ``label_noise`` of them
carries the environment's characteristic mistake (for ``arith``: every carry dropped). With
``label_noise`` above one half, the most likely answer the data teaches for a carry problem is
the wrong one, so imitation plateaus: continued supervised training on the same data cannot
lift greedy accuracy past the share of problems without carries, while the model still produces
the right answer often enough under sampling for an exact-match reward to find it. Loss is the
mean cross-entropy over completion tokens (answer and EOS), the prompt is context only.

Sequence layout (right-padded): ``<bos> prompt completion <eos> <pad>...`` (see
``swarmrl.model.prompts``).

Knows nothing about RL or generation; :func:`greedy_exact_match` checks greedy correctness by
teacher forcing (greedy decoding yields the reference exactly when every reference token is the
argmax given the reference prefix), which is exact and needs one forward pass.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.envs import Environment, Task
from swarmrl.model.prompts import PromptLike, encode_prompts


@dataclass
class SFTData:
    """Padded examples: ``input_ids`` ``[N, T]`` and ``loss_mask`` ``[N, T-1]`` (1 where the
    next token is a completion token)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor


def encode_examples(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str | PromptLike],
    completions: Sequence[str],
) -> SFTData:
    """Tokenize ``<bos> prompt completion <eos>`` rows, right-padded."""
    rows, starts = [], []
    eos = [tokenizer.eos_token_id]
    encoded = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    for p, c in zip(encode_prompts(tokenizer, prompts), encoded, strict=True):
        rows.append(p + list(c) + eos)
        starts.append(len(p))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, start - 1 : len(row) - 1] = 1.0  # position j predicts token j+1
    return SFTData(ids, mask)


def warm_start_examples(
    env: Environment, tokenizer: PreTrainedTokenizerBase, n: int, label_noise: float, seed: int
) -> SFTData:
    """The fixed warm-start set: ``n`` training tasks, a ``label_noise`` share flawed."""
    rng = random.Random(seed)
    tasks = env.sample("train", n, seed)
    flawed = set(rng.sample(range(n), round(n * label_noise)))
    completions = [env.demonstration(t, flawed=i in flawed) for i, t in enumerate(tasks)]
    return encode_examples(tokenizer, tasks, completions)


def sft_loss(
    model: PreTrainedModel, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    logits = model(input_ids=input_ids).logits[:, :-1].float()  # [B, T-1, V]
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), input_ids[:, 1:], reduction="none"
    )  # [B, T-1]
    return (nll * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


@dataclass
class SFTTrainer:
    """AdamW on minibatches drawn (seeded) from a fixed :class:`SFTData`."""

    model: PreTrainedModel
    data: SFTData
    batch_size: int
    lr: float
    seed: int
    step: int = 0

    def __post_init__(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(self.seed)

    def train_step(self) -> float:
        self.model.train()
        n = self.data.input_ids.shape[0]
        idx = torch.randint(0, n, (min(self.batch_size, n),), generator=self.generator)
        loss = sft_loss(self.model, self.data.input_ids[idx], self.data.loss_mask[idx])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        self.model.eval()
        return float(loss.detach())

    def run(
        self,
        steps: int | None = None,
        seconds: float | None = None,
        on_step: Callable[[int, float], None] | None = None,
    ) -> float:
        """Train for ``steps`` steps or ``seconds`` of wall clock, whichever is given (both:
        whichever ends first). Returns the last loss."""
        if steps is None and seconds is None:
            raise ValueError("give steps or seconds")
        start, loss, done = time.perf_counter(), float("nan"), 0
        while (steps is None or done < steps) and (
            seconds is None or time.perf_counter() - start < seconds
        ):
            loss = self.train_step()
            done += 1
            if on_step is not None:
                on_step(self.step, loss)
        return loss


@torch.no_grad()
def greedy_exact_match(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tasks: Sequence[Task]
) -> float:
    """Share of ``tasks`` whose greedy completion equals the reference (by teacher forcing)."""
    data = encode_examples(tokenizer, tasks, [t.answer for t in tasks])
    logits = model(input_ids=data.input_ids).logits[:, :-1]  # [N, T-1, V]
    hits = (logits.argmax(-1) == data.input_ids[:, 1:]) | (data.loss_mask == 0)
    return float(hits.all(dim=1).float().mean())
