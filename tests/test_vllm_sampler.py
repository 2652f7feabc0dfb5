"""The vLLM logits processor against the reference sampling rule, without starting an engine.

``SeededGumbelLogits`` is driven directly with vLLM's own ``BatchUpdate`` records: every seeded
row must come out as ``mask_logits(z) + gumbel_noise(seed, step)`` (so vLLM's argmax is the
token ``sample_tokens`` picks), with the log-prob of the declared distribution recorded, and
every other row left untouched — across mixed distributions, rows that are not contiguous,
rows moved within the batch, and a batch that shrinks. Skipped where vLLM is not installed.
"""

from __future__ import annotations

import pytest
import torch

from swarmrl.inference import interface
from swarmrl.inference.sampling import gumbel_noise, mask_logits, sample_tokens
from swarmrl.protocol import SamplingParams

pytestmark = pytest.mark.skipif(not interface.vllm_available(), reason="vLLM not installed")

VOCAB = 50


def _request(key: str, seed: int | None, rule: SamplingParams):
    from vllm import SamplingParams as VllmParams

    from swarmrl.inference.vllm_engine import KEY, RULE, SEED

    args = {KEY: key, RULE: [rule.temperature, rule.top_k, rule.top_p]}
    if seed is not None:
        args[SEED] = seed
    return VllmParams(temperature=0.0, max_tokens=8, extra_args=args)


def _update(size: int, added=(), removed=(), moved=()):
    from vllm.v1.sample.logits_processor import BatchUpdate

    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=moved)


def _expected(logits: torch.Tensor, rule: SamplingParams, seed: int, step: int):
    """(row the processor must write, token, log-prob) by the reference rule."""
    masked = mask_logits(logits[None], rule)[0]
    seeds = torch.tensor([seed])
    token, logprob = sample_tokens(logits[None], rule, seeds, step)
    if rule.greedy:
        return masked, int(token), float(logprob)
    return masked + gumbel_noise(seeds, step, VOCAB)[0], int(token), float(logprob)


def test_seeded_rows_become_the_reference_rule_and_others_stay():
    from vllm.v1.sample.logits_processor import MoveDirectionality

    from swarmrl.inference import vllm_plugin

    hot = SamplingParams(temperature=1.0)
    cut = SamplingParams(temperature=0.7, top_k=7, top_p=0.9)
    greedy = SamplingParams(temperature=0.0)
    outputs = {name: [] for name in "abcdef"}  # vLLM's live output-token lists
    proc = vllm_plugin.SeededGumbelLogits(None, torch.device("cpu"), False)
    # rows: 0 a(hot) 1 b(cut) 2 plain 3 c(hot) 4 d(greedy) 5 e(cut)
    layout = {"a": (11, hot), "b": (22, cut), "c": (33, hot), "d": (44, greedy), "e": (55, cut)}
    added = [
        (i, _request(k, layout[k][0], layout[k][1]), None, outputs[k])
        for i, k in [(0, "a"), (1, "b"), (3, "c"), (4, "d"), (5, "e")]
    ]
    added.append((2, _request("plain", None, hot), None, outputs["f"]))
    proc.update_state(_update(6, added=added))
    g = torch.Generator().manual_seed(0)
    rows = {0: "a", 1: "b", 3: "c", 4: "d", 5: "e"}
    for step in range(3):
        if step == 2:  # e moves into row 2 over the plain request, a and c swap, b leaves
            proc.update_state(
                _update(
                    5,
                    removed=[1],
                    moved=[
                        (5, 2, MoveDirectionality.UNIDIRECTIONAL),
                        (0, 3, MoveDirectionality.SWAP),
                    ],
                )
            )
            rows = {3: "a", 0: "c", 4: "d", 2: "e"}
        batch = 6 if step < 2 else 5
        logits = torch.randn(batch, VOCAB, generator=g)
        before = logits.clone()
        out = proc.apply(logits)
        for index in range(batch):
            key = rows.get(index)
            if key is None:
                assert torch.equal(out[index], before[index])  # unseeded rows untouched
                continue
            seed, rule = layout[key]
            row, token, logprob = _expected(before[index], rule, seed, len(outputs[key]))
            assert torch.equal(out[index], row), (step, key)
            assert int(torch.argmax(out[index])) == token
            recorded = vllm_plugin._RECORDS[key].logprobs[len(outputs[key])]
            assert recorded == pytest.approx(logprob, abs=1e-6)
            outputs[key].append(token)
    assert {k: len(v) for k, v in outputs.items()} == dict(a=3, b=2, c=3, d=3, e=3, f=0)
    vllm_plugin._RECORDS.clear()
