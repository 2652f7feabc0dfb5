"""rl.loss, rl.correction and rl.kl through the trainer's optimizer step on a tiny model: each
choice trains, the normalisers and corrections do what the docs say, and the mismatch between
the trainer's and the behaviour log-probs is measured every step."""

import copy
import math

import pytest
import torch

from swarmrl.config.model import TinyModelConfig
from swarmrl.config.rl import RLConfig
from swarmrl.envs import Task
from swarmrl.model import build_char_tokenizer, create_tiny_model
from swarmrl.rl import clipped_token_loss, importance_ratio, token_logprobs
from swarmrl.trainer.batch import Completion, Group, collate
from swarmrl.trainer.step import make_optimizer, policy_step

TASK = Task(problem_id=0, split="train", index=0, prompt="1+1=", answer="2")


@pytest.fixture()
def tiny():
    torch.manual_seed(0)
    tok = build_char_tokenizer("0123456789+=")
    return create_tiny_model(
        TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), tok
    )


def _batch(model, shift=0.0):
    """Three groups of three; behaviour log-probs = the model's own minus ``shift`` (so the
    trainer/behaviour ratio is exp(shift) on every loss token)."""
    torch.manual_seed(1)
    groups = []
    for _ in range(3):
        group = Group(TASK)
        for j in range(3):
            prompt = [1, *torch.randint(4, 16, (3,)).tolist()]
            output = torch.randint(4, 16, (1 + j,)).tolist()
            group.completions.append(Completion(prompt, output, [0.0] * len(output), float(j == 0)))
        groups.append(group)
    batch = collate(groups, 0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch.input_ids)
    batch.behaviour_logp = (logp - shift) * batch.loss_mask
    return batch


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("loss", ["clip", "dr_grpo", "dapo", "gspo", "cispo", "tr_mask"])
def test_every_loss_takes_a_step_that_moves_the_policy(tiny, loss):
    rl = RLConfig(lr=1e-2, loss=loss)
    batch = _batch(tiny, shift=0.1)
    model = copy.deepcopy(tiny)
    stats = policy_step(model, make_optimizer(model, rl), batch, rl)
    assert math.isfinite(stats.loss) and stats.grad_norm > 0
    assert any(
        not torch.equal(p, q) for p, q in zip(model.parameters(), tiny.parameters(), strict=True)
    )


def test_the_default_step_is_the_two_sided_clip_over_loss_tokens(tiny):
    rl = RLConfig(lr=1e-2)
    batch = _batch(tiny, shift=0.3)  # ratios 1.35: the clip is active for positive advantages
    model = copy.deepcopy(tiny)
    stats = policy_step(model, make_optimizer(model, rl), batch, rl)
    by_hand = copy.deepcopy(tiny)
    logp, _ = token_logprobs(by_hand, batch.input_ids)
    ratio = importance_ratio(logp, batch.behaviour_logp)
    token_loss, _ = clipped_token_loss(ratio, batch.advantages)
    ((token_loss * batch.loss_mask).sum() / batch.loss_mask.sum()).backward()
    assert stats.loss == pytest.approx(
        float((token_loss * batch.loss_mask).sum() / batch.loss_mask.sum()), rel=1e-6
    )
    norm = float(torch.linalg.vector_norm(_grads(by_hand)))
    assert stats.grad_norm == pytest.approx(norm, rel=1e-5)
    assert stats.corrected_fraction == 0.0


def test_dr_grpo_divides_by_sequences_times_max_new_tokens(tiny):
    batch = _batch(tiny)  # on policy: ℓ = −A on every loss token
    clip, dr = RLConfig(lr=1e-2), RLConfig(lr=1e-2, loss="dr_grpo")
    a, b = copy.deepcopy(tiny), copy.deepcopy(tiny)
    token_mean = policy_step(a, make_optimizer(a, clip), batch, clip).loss
    dr_loss = policy_step(b, make_optimizer(b, dr), batch, dr).loss
    summed = token_mean * batch.loss_tokens
    assert dr_loss == pytest.approx(summed / (9 * dr.sampling.max_new_tokens), abs=1e-6)


def test_mismatch_is_measured_and_the_corrections_act_on_it(tiny):
    shift = 0.3  # trainer/behaviour ratio r = exp(0.3) ≈ 1.35 on every loss token
    batch = _batch(tiny, shift=shift)
    expected_kl = math.exp(shift) - 1 - shift

    def step(**kw):
        rl = RLConfig(lr=1e-2, **kw)
        model = copy.deepcopy(tiny)
        return policy_step(model, make_optimizer(model, rl), batch, rl), model

    plain, _ = step()
    assert plain.mismatch_kl == pytest.approx(expected_kl, rel=1e-4)
    kept, _ = step(correction="mask_token", correction_low=0.5, correction_high=2.0)
    assert kept.corrected_fraction == 0.0 and kept.mismatch_kl == pytest.approx(expected_kl, 1e-4)
    # with the ratio taken against the trainer's own log-probs nothing is clipped any more
    assert kept.clip_fraction == 0.0 < plain.clip_fraction
    masked, model = step(correction="mask_token", correction_low=0.5, correction_high=1.2)
    assert masked.corrected_fraction == 1.0 and masked.loss == 0.0
    assert float(torch.linalg.vector_norm(_grads(model))) == 0.0  # nothing left to learn from
    truncated, _ = step(correction="tis_token", correction_cap=1.1)
    assert truncated.corrected_fraction == 1.0
    # every token weighs min(r, 1.1) = 1.1 instead of r: the on-trainer loss is −1.1·A
    untruncated, _ = step(correction="tis_token", correction_cap=2.0)
    assert untruncated.corrected_fraction == 0.0
    assert truncated.loss == pytest.approx(untruncated.loss * 1.1 / math.exp(shift), rel=1e-4)
    on_policy, _ = step(correction="tis_sequence")
    assert 0.0 < on_policy.corrected_fraction  # the 3-token sequences' product 2.46 > cap 2


def test_the_correction_uses_each_samples_age(tiny):
    shift = 0.3  # r = exp(0.3) ≈ 1.35 on every loss token: under cap 2, above 2^0.25 ≈ 1.19
    batch = _batch(tiny, shift=shift)
    # the second and third groups were generated 1 and 2 versions before the trained one
    batch.age = torch.tensor([[0.0]] * 3 + [[1.0]] * 3 + [[2.0]] * 3)
    aged_tokens = float(batch.loss_mask[3:].sum()) / batch.loss_tokens
    old_tokens = float(batch.loss_mask[6:].sum()) / batch.loss_tokens

    def step(**kw):
        rl = RLConfig(lr=1e-2, correction="tis_token", correction_cap=2.0, **kw)
        model = copy.deepcopy(tiny)
        return policy_step(model, make_optimizer(model, rl), batch, rl)

    assert step().corrected_fraction == 0.0  # decay 1: age changes nothing
    # γ = 0.5: cap 2^0.5 ≈ 1.41 at age 1 keeps 1.35, cap 2^0.25 ≈ 1.19 at age 2 truncates it
    assert step(correction_decay=0.5).corrected_fraction == pytest.approx(old_tokens)
    # γ = 0: every sample of age ≥ 1 is capped at 1
    assert step(correction_decay=0.0).corrected_fraction == pytest.approx(aged_tokens)
