"""The verifier's isolated-miss rules on hand-made numbers (``swarmrl.toploc.replay``): how
many tokens of a sample may miss the replay, and by how much, for log-probs and for the seeded
sampling choice. The same rules inside the whole verifier: ``test_toploc_verify.py``."""

import pytest
import torch

from swarmrl.inference.sampling import gumbel_noise, sample_tokens
from swarmrl.protocol import SamplingParams
from swarmrl.toploc.replay import check_logprobs, replay_sampling, replay_sampling_many


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


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=9),
        SamplingParams(temperature=1.0, max_new_tokens=9),
        SamplingParams(temperature=0.0, max_new_tokens=9),
    ],
)
def test_sampling_replay_of_many_samples_keys_noise_per_sample(params):
    """Samples of different lengths and seeds replayed in one pass: each is checked against
    its own seed's noise from step 0, as the engine sampled it (``sample_tokens``), and a token
    changed in one sample flags that sample alone."""
    torch.manual_seed(0)
    vocab, lengths, seeds = 11, [3, 9, 1, 6], [5, 2**40 + 3, 77, 5]
    logits, tokens, logprobs = [], [], []
    for n, seed in zip(lengths, seeds, strict=True):
        z = torch.randn(n, vocab) * 2  # [n, vocab]
        picked, lp = zip(
            *(sample_tokens(z[t : t + 1], params, torch.tensor([seed]), t) for t in range(n)),
            strict=True,
        )
        logits.append(z)
        tokens.append([int(p) for p in picked])
        logprobs.append(torch.cat(lp))
    many = replay_sampling_many(logits, tokens, params, seeds, 1e-4, 0.0)
    assert [r.bad_steps for r in many] == [[], [], [], []]
    for replay, expected in zip(many, logprobs, strict=True):
        assert torch.allclose(replay.logprobs.float(), expected, atol=1e-5)
    wrong = [list(t) for t in tokens]
    order = torch.argsort(logits[1][4], descending=True)  # step 4 of sample 1
    wrong[1][4] = int(order[1] if int(order[0]) == tokens[1][4] else order[0])
    flagged = replay_sampling_many(logits, wrong, params, seeds, 1e-4, 0.0)
    assert [r.bad_steps for r in flagged] == [[], [4], [], []]
    assert replay_sampling_many([], [], params, [], 1e-4, 0.0) == []
