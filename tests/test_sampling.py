"""Seeded Gumbel-max sampling: the documented noise formula, masks, and the sampling law."""

from __future__ import annotations

import math

import pytest
import torch

from swarmrl.inference.sampling import gumbel_block, gumbel_noise, mask_logits, sample_tokens
from swarmrl.protocol import SamplingParams

M32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


def _reference_noise(seed: int, step: int, v: int) -> float:
    """The formula of the sampling module docstring, in plain Python integers and floats."""
    lo, hi = seed & M32, seed >> 32
    key = _mix32(_mix32(_mix32((hi + 0x9E3779B9) & M32) ^ lo) ^ step)
    h = _mix32(key ^ _mix32((v + 0x6A09E667) & M32))
    u = ((h >> 8) + 0.5) / 2**24
    return -math.log(-math.log(u))


def test_noise_matches_the_documented_formula() -> None:
    seeds = [0, 1, 12345, 2**40 + 7, 2**63 - 1]
    for step in (0, 1, 31, 2**20):
        noise = gumbel_noise(torch.tensor(seeds), step, 50)
        for i, seed in enumerate(seeds):
            for v in (0, 1, 17, 49):
                expected = torch.tensor(_reference_noise(seed, step, v), dtype=torch.float32)
                assert noise[i, v] == expected


def test_noise_depends_only_on_seed_and_step() -> None:
    batch = gumbel_noise(torch.tensor([5, 9, 5, 11]), 3, 40)
    alone = gumbel_noise(torch.tensor([9]), 3, 40)
    assert torch.equal(batch[1], alone[0])
    assert torch.equal(batch[0], batch[2])
    assert not torch.equal(batch[0], batch[3])
    assert not torch.equal(batch[0], gumbel_noise(torch.tensor([5]), 4, 40)[0])
    # a longer vocabulary extends the row without changing its start
    assert torch.equal(gumbel_noise(torch.tensor([9]), 3, 80)[0, :40], alone[0])


def test_noise_is_standard_gumbel() -> None:
    g = gumbel_noise(torch.arange(200), 0, 5000).double()
    assert abs(g.mean().item() - 0.5772) < 0.01
    assert abs(g.std().item() - math.pi / math.sqrt(6)) < 0.01
    with pytest.raises(ValueError):
        gumbel_noise(torch.tensor([-1]), 0, 10)


def test_sampled_frequencies_follow_softmax() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log().expand(n, 4)
    tokens, logprobs = sample_tokens(logits, SamplingParams(), torch.arange(n), 0)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015)
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)


def test_temperature_scales_logits_before_sampling() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(20000, 3)
    params = SamplingParams(temperature=0.5)
    tokens, logprobs = sample_tokens(logits, params, torch.arange(20000), 7)
    expected = torch.softmax(logits[0] / 0.5, -1)
    assert torch.allclose(torch.bincount(tokens, minlength=3).float() / 20000, expected, atol=0.015)
    assert torch.allclose(logprobs, expected.log()[tokens], atol=1e-6)


def test_top_k_keeps_the_k_largest_and_renormalises() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0]])
    masked = mask_logits(logits, SamplingParams(top_k=2))
    assert torch.isinf(masked[0, [0, 2]]).all() and torch.isfinite(masked[0, [1, 3]]).all()
    tokens, logprobs = sample_tokens(
        logits.expand(500, 4), SamplingParams(top_k=2), torch.arange(500), 0
    )
    assert set(tokens.tolist()) == {1, 3}
    kept = torch.log_softmax(torch.tensor([5.0, 4.0]), -1)
    assert torch.allclose(logprobs, torch.where(tokens == 1, kept[0], kept[1]))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()

    def kept(p: float) -> list[int]:
        masked = mask_logits(logits, SamplingParams(top_p=p))
        return torch.isfinite(masked)[0].nonzero().flatten().tolist()

    assert kept(0.5) == [1]
    assert kept(0.7) == [1, 3]
    assert kept(0.85) == [0, 1, 3]
    assert kept(1.0) == [0, 1, 2, 3]
    params = SamplingParams(top_p=0.7)
    tokens, logprobs = sample_tokens(logits.expand(4000, 4), params, torch.arange(4000), 2)
    assert set(tokens.tolist()) == {1, 3}
    assert torch.allclose(logprobs[tokens == 1], torch.tensor(0.5 / 0.8).log())
    freq_1 = (tokens == 1).float().mean().item()
    assert abs(freq_1 - 0.5 / 0.8) < 0.03


def test_top_k_then_top_p() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-k 3 renormalises to (4/9, 3/9, 2/9); p = 0.5 then keeps ids 0 and 1
    masked = mask_logits(logits, SamplingParams(top_k=3, top_p=0.5))
    assert torch.isfinite(masked)[0].tolist() == [True, True, False, False]


def test_greedy_is_argmax_with_temperature_one_logprobs() -> None:
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    tokens, logprobs = sample_tokens(
        logits, SamplingParams(temperature=0.0), torch.tensor([1, 2]), 0
    )
    assert tokens.tolist() == [1, 0]  # the lowest id wins an exact tie
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_sampling_params_reject_bad_values() -> None:
    for bad in (
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(max_new_tokens=0),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_noise_block_equals_step_by_step_noise() -> None:
    seeds = torch.tensor([3, 2**40 + 1, 77])
    block = gumbel_block(seeds, 5, 4, 30)
    assert block.shape == (3, 4, 30)
    for j in range(4):
        assert torch.equal(block[:, j], gumbel_noise(seeds, 5 + j, 30))
    logits = torch.randn(3, 30)
    with_block = sample_tokens(logits, SamplingParams(), seeds, 6, noise=block[:, 1])
    plain = sample_tokens(logits, SamplingParams(), seeds, 6)
    assert torch.equal(with_block[0], plain[0]) and torch.equal(with_block[1], plain[1])


def test_seed_rule_is_the_documented_sha256_text():
    import hashlib

    from swarmrl.protocol.seeds import derive_seed, sample_seed

    digest = hashlib.sha256(b"swarmrl-seed-v1:sample:12345:7").digest()
    assert sample_seed(12345, 7) == derive_seed("sample", 12345, 7)
    assert sample_seed(12345, 7) == int.from_bytes(digest[:8], "big") >> 1
    assert 0 <= derive_seed("eval", -3, "ab") < 2**63
    assert derive_seed("tasks", 0, 1) != derive_seed("tasks", 1, 0)
    with pytest.raises(ValueError, match="separator"):
        derive_seed("a:b")
    with pytest.raises(TypeError):
        derive_seed(True)


def test_one_sampling_type_from_config_to_wire_to_engine() -> None:
    """The config section, a pool's work unit, a proof bundle and the engine share one type."""
    from swarmrl.config import load_config
    from swarmrl.protocol import PoolSpec
    from swarmrl.protocol.proofs import ProofBundle

    section = load_config([], ["rl.sampling.top_k=7", "rl.sampling.max_new_tokens=9"]).rl.sampling
    params = SamplingParams.model_validate(section.model_dump())
    assert (params.top_k, params.max_new_tokens, params.stop_token_ids) == (7, 9, ())
    assert PoolSpec.model_fields["sampling"].annotation is SamplingParams
    assert ProofBundle.model_fields["sampling"].annotation is SamplingParams
    wire = SamplingParams.model_validate_json('{"max_new_tokens": 4, "stop_token_ids": [5]}')
    assert wire == SamplingParams(max_new_tokens=4, stop_token_ids=(5,))
    for bad in ('{"top_k": 1, "extra": 1}', '{"temperature": NaN}', '{"stop_token_ids": [-1]}'):
        with pytest.raises(ValueError):
            SamplingParams.model_validate_json(bad)
    with pytest.raises(ValueError):
        params.temperature = 0.5  # frozen: a work unit's parameters cannot drift after checks
