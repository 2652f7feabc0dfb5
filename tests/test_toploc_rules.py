"""The verifier's isolated-miss rules on hand-made numbers (``swarmrl.toploc.replay``): how
many tokens of a sample may miss the replay, and by how much, for log-probs and for the seeded
sampling choice. The same rules inside the whole verifier: ``test_toploc_verify.py``."""

import pytest
import torch

from swarmrl.inference.sampling import gumbel_noise
from swarmrl.protocol import SamplingParams
from swarmrl.toploc.replay import check_logprobs, replay_sampling


def test_logprob_rule_on_the_measured_patterns():
    """The rule on the gaps measured: the demo's honest miss passes, the weakest sample of the
    1e-3 weight-noise cheat in ``bench/toploc.py`` (8 of 13 tokens off, worst 7.1e-4) fails."""
    honest = [1.6e-6, -3.9e-4, 1e-6, -1.6e-6, 1e-6]  # decode steps 0-4 of the demo's sample
    checked = check_logprobs(honest, torch.zeros(5), 1e-4, 0.25, 10.0)
    assert checked.passed and checked.off == [1] and checked.allowed == 1
    cheat = [
        1e-5,
        1.7e-4,
        -2e-4,
        5e-5,
        3e-4,
        -7.1e-4,
        2e-5,
        4e-4,
        -1.8e-4,
        6e-5,
        2.5e-4,
        9e-5,
        1.2e-4,
    ]
    checked = check_logprobs(cheat, torch.zeros(13), 1e-4, 0.25, 10.0)
    assert not checked.passed and len(checked.off) == 8 and checked.allowed == 3
    assert "isolated" in (checked.problem(1e-4, 1e-3) or "")
    assert not check_logprobs([-3.9e-4], torch.zeros(1), 1e-4, 0.25, 1.0).passed  # no outliers
    assert check_logprobs([], torch.zeros(0), 1e-4, 0.25, 10.0).passed


def test_sampling_rule_counts_and_caps_isolated_misses():
    """replay_sampling on hand-made logits: exact winners except where a token trails."""
    vocab, n, seed = 5, 8, 7
    noise = gumbel_noise(torch.full((n,), seed), torch.arange(n), vocab)  # [n, vocab]
    logits = torch.zeros(n, vocab)
    logits[:, 0] = 40.0  # token 0 wins every step by far
    tokens = [0] * n
    params = SamplingParams(temperature=1.0, max_new_tokens=n)

    def trailing(steps: list[int], by: float, share: float = 0.0):
        shifted = logits.clone()
        for t in steps:  # token 1 now beats token 0 by ``by``
            shifted[t, 1] = 40.0 + float(noise[t, 0] - noise[t, 1]) + by
        return replay_sampling(shifted, tokens, params, seed, 1e-4, 0.0, share, 10.0)

    one = trailing([2], 3e-4)
    assert one.bad_steps == [] and one.near_ties == [2]
    assert one.worst_margin == pytest.approx(3e-4, abs=2e-5)
    assert trailing([2], 1.5e-3).bad_steps == [2]
    assert trailing([2, 6], 3e-4).bad_steps == [2, 6]
    assert trailing([2, 6], 3e-4, share=0.25).near_ties == [2, 6]  # max(1, 8 // 4) = 2
    shifted = logits.clone()
    shifted[2, 1] = 40.0 + float(noise[2, 0] - noise[2, 1]) + 3e-4
    strict = replay_sampling(shifted, tokens, params, seed, 1e-4, 0.0)
    assert strict.bad_steps == [2]  # the defaults admit no isolated miss
