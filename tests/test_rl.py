import math

import pytest
import torch

from swarmrl.config.model import TinyModelConfig
from swarmrl.model import build_char_tokenizer, create_tiny_model
from swarmrl.rl import (
    clip_grad_norm,
    clipped_token_loss,
    fill_with_informative,
    group_advantages,
    importance_ratio,
    is_informative,
    k3_kl,
    pass_rate_mask,
    token_logprobs,
)


def test_group_advantages_std_and_mean():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    std = group_advantages(rewards, "std")
    assert torch.allclose(std[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(std[1], torch.zeros(4))  # equal rewards: no signal, no NaN
    mean = group_advantages(rewards, "mean")
    assert torch.allclose(mean[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError):
        group_advantages(rewards[0], "std")


def test_ratio_clamps_log_ratio_before_exp():
    logp = torch.tensor([0.0, -1.0, 1000.0, -1000.0])
    behaviour = torch.tensor([0.0, -2.0, 0.0, 0.0])
    ratio = importance_ratio(logp, behaviour, max_log_ratio=10.0)
    assert torch.isfinite(ratio).all()
    assert ratio.tolist() == pytest.approx([1.0, math.e, math.exp(10), math.exp(-10)])


def test_clipped_loss_hand_values():
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.1, 1.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    loss, clipped = clipped_token_loss(ratio, adv, eps_low=0.2, eps_high=0.2, delta=4.0)
    # 1.5,A=1: max(-1.5,-1.2) = -1.2 (clipped); 0.5,A=1: max(-0.5,-0.8) = -0.5;
    # 0.5,A=-1: max(0.5,0.8) = 0.8 (clipped); 1.1,A=-1: 1.1; 1.0,A=2: -2
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 0.8, 1.1, -2.0])
    assert clipped.tolist() == [True, False, True, False, False]


def test_delta_caps_the_loss_for_negative_advantages():
    ratio = torch.tensor([10.0, 100.0], requires_grad=True)
    adv = torch.tensor([-1.0, -2.0])
    loss, _ = clipped_token_loss(ratio, adv, delta=4.0)
    assert loss.tolist() == pytest.approx([4.0, 8.0])  # δ·|A|, not ρ·|A| (10, 200)
    loss.sum().backward()
    assert ratio.grad.tolist() == [0.0, 0.0]  # beyond δ the token stops pushing
    # below δ the unclipped term carries the gradient −A
    r = torch.tensor([3.0], requires_grad=True)
    clipped_token_loss(r, torch.tensor([-1.0]), delta=4.0)[0].sum().backward()
    assert r.grad.tolist() == [1.0]


def test_k3_kl_value_and_real_gradient():
    logp = torch.tensor([math.log(0.5), math.log(0.3)], requires_grad=True)
    ref = torch.tensor([math.log(0.25), math.log(0.3)])
    kl = k3_kl(logp, ref)
    assert kl.tolist() == pytest.approx([0.5 - math.log(0.5) - 1.0, 0.0], abs=1e-6)
    kl.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.5, 0.0], abs=1e-6)  # d/dlogp = 1 − exp(d)


def test_filters():
    rewards = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.25, 0.5]]
    assert [is_informative(r) for r in rewards] == [False, True, False, True]
    assert pass_rate_mask(torch.tensor([0.0, 0.1, 0.5, 0.8, 0.9]), 0.1, 0.8).tolist() == [
        False,
        True,
        True,
        True,
        False,
    ]

    class Group:
        def __init__(self, rewards):
            self.rewards = rewards

    calls = []

    def sample(n, round_):
        calls.append((n, round_))
        # round 0: half informative; later rounds: all informative
        return [Group([0.0, float(round_ > 0 or i % 2)]) for i in range(n)]

    kept, sampled = fill_with_informative(sample, need=4, max_extra_rounds=3)
    assert len(kept) == 4 and calls == [(4, 0), (2, 1)] and sampled == 6
    kept, _ = fill_with_informative(lambda n, r: [Group([1.0, 1.0])] * n, 4, 2)
    assert kept == []


def test_clip_grad_norm_scales_to_max():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([p], 1.0) == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-4)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tok = build_char_tokenizer("0123456789+=")
    cfg = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    return create_tiny_model(cfg, tok)


@pytest.mark.slow
def test_chunked_logprobs_match_full_logits_and_gradients(tiny):
    ids = torch.randint(4, 16, (3, 11))
    full = torch.log_softmax(tiny(input_ids=ids).logits[:, :-1].float() / 0.7, -1)
    expect = full.gather(-1, ids[:, 1:, None]).squeeze(-1)
    expect_entropy = -(full.exp() * full).sum(-1)
    logp, entropy = token_logprobs(tiny, ids, chunk=3, temperature=0.7, with_entropy=True)
    assert torch.allclose(logp, expect, atol=1e-5)
    assert torch.allclose(entropy, expect_entropy, atol=1e-5)

    def grads(chunk):
        tiny.zero_grad()
        token_logprobs(tiny, ids, chunk=chunk)[0].sum().backward()
        return [p.grad.clone() for p in tiny.parameters()]

    for a, b in zip(grads(4), grads(1024), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
