"""The loss family, the KL estimators and the off-policy corrections against references written
out by hand, token by token, in plain floats (value and gradient). Each reference takes a
``mutant`` that changes one term of its formula; the small batch below is chosen so every
mutant gives a different value or gradient, so each check would catch that one-term slip."""

import math

import pytest
import torch

from swarmrl.config.load import ConfigError, load_config
from swarmrl.config.rl import RLConfig
from swarmrl.rl import (
    cispo_token_loss,
    clipped_token_loss,
    correction_weights,
    dapo_token_loss,
    gspo_token_loss,
    importance_ratio,
    kl_penalty,
    mismatch_kl,
    normaliser,
    trust_region_token_loss,
)
from swarmrl.trainer.step import policy_token_loss

# Two sequences, three positions; the second position of sequence 0 is padding.
# log-ratios d = logp − behaviour: ρ = 1.25 (inside DAPO's clip-higher band only), 0.905,
# 7.39 (beyond δ = 4), 0.0498 (below the trust band's 0.125), 1.05.
BEHAVIOUR = [[-1.0, -2.0, 0.0], [-0.5, -1.5, -2.5]]
LOG_RATIO = [[math.log(1.25), -0.1, 0.0], [2.0, -3.0, 0.05]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
ADV = [1.0, -0.5]
MAX_NEW = 6  # L_max of Dr. GRPO


def _tensors():
    behaviour = torch.tensor(BEHAVIOUR, dtype=torch.float64)
    logp = (behaviour + torch.tensor(LOG_RATIO, dtype=torch.float64)).requires_grad_(True)
    mask = torch.tensor(MASK, dtype=torch.float64)
    adv = torch.tensor(ADV, dtype=torch.float64).reshape(2, 1)
    return logp, behaviour, mask, adv


def _tokens():
    """(i, t, d, A) for each loss token."""
    return [
        (i, t, LOG_RATIO[i][t], ADV[i]) for i in range(2) for t in range(3) if MASK[i][t] == 1.0
    ]


def _clip_grad_value(rho, a, lo, hi, cap):
    """Value and d/dlogp of max(−c1·A, −c2·A), c1 = min(ρ, cap) (cap None: c1 = ρ)."""
    c1 = rho if cap is None else min(rho, cap)
    c2 = min(max(c1, 1 - lo), 1 + hi)
    value = max(-c1 * a, -c2 * a)
    in_unclipped = (-c1 * a >= -c2 * a) and (cap is None or rho < cap)
    return value, (-a * rho if in_unclipped else 0.0)


def _reference(loss, mutant=False):
    """(L, dL/dlogp as a 2×3 list) of ``loss`` on the batch above, written out by hand."""
    grad = [[0.0] * 3 for _ in range(2)]
    total = 0.0
    n_tokens = sum(map(sum, MASK))
    if loss in ("clip", "dr_grpo", "dapo"):
        lo, hi = (0.2, 0.2) if loss != "dapo" or mutant else (0.2, 0.28)
        cap = None if loss == "dapo" or (loss == "clip" and mutant) else 4.0
        norm = 2 * MAX_NEW if loss == "dr_grpo" and not mutant else n_tokens
        for i, t, d, a in _tokens():
            value, g = _clip_grad_value(math.exp(d), a, lo, hi, cap)
            total += value
            grad[i][t] = g
        return total / norm, [[g / norm for g in row] for row in grad]
    if loss == "gspo":
        for i in range(2):
            ds = [LOG_RATIO[i][t] for t in range(3) if MASK[i][t]]
            n = len(ds)
            s = math.exp(sum(ds) if mutant else sum(ds) / n)  # mutant: no length normalisation
            value, g = _clip_grad_value(s, ADV[i], 0.2, 0.2, None)  # g = d/dlog s
            total += value
            for t in range(3):
                if MASK[i][t]:
                    grad[i][t] = g * (1.0 if mutant else 1.0 / n)
        return total / 2, [[g / 2 for g in row] for row in grad]
    if loss == "cispo":
        for i, t, d, a in _tokens():
            rho = math.exp(d)
            w = min(max(rho, 0.8), 1.2)
            logp = BEHAVIOUR[i][t] + d
            total += -w * a * logp
            # mutant: no stop-gradient, so d/dlogp of w·logp adds logp·dw/dlogp = logp·ρ inside
            dw = rho if (mutant and 0.8 < rho < 1.2) else 0.0
            grad[i][t] = -a * (w + logp * dw)
        return total / n_tokens, [[g / n_tokens for g in row] for row in grad]
    if loss == "tr_mask":
        for i, t, d, a in _tokens():
            rho = math.exp(d)
            if mutant or 0.125 <= rho <= 8.0:  # mutant: no band
                total += -rho * a
                grad[i][t] = -rho * a
        return total / n_tokens, [[g / n_tokens for g in row] for row in grad]
    raise AssertionError(loss)


LOSSES = ["clip", "dr_grpo", "dapo", "gspo", "cispo", "tr_mask"]


def _implementation(loss):
    """L and its gradient from the code: the step's dispatch, then Σ ℓ·mask / N."""
    eps_high = 0.28 if loss == "dapo" else 0.2
    rl = RLConfig(loss=loss, eps_low=0.2, eps_high=eps_high)
    logp, behaviour, mask, adv = _tensors()
    token_loss, _ = policy_token_loss(rl, logp, behaviour, adv, mask)
    norm = normaliser(loss, float(mask.sum()), 2.0, MAX_NEW)
    total = (token_loss * mask).sum() / norm
    total.backward()
    return float(total.detach()), logp.grad.tolist()


@pytest.mark.parametrize("loss", LOSSES)
def test_each_loss_matches_its_hand_reference_in_value_and_gradient(loss):
    value, grad = _implementation(loss)
    ref_value, ref_grad = _reference(loss)
    assert value == pytest.approx(ref_value, abs=1e-9)
    assert grad == [pytest.approx(row, abs=1e-9) for row in ref_grad]


@pytest.mark.parametrize("loss", LOSSES)
def test_each_loss_check_catches_a_one_term_mutant(loss):
    """Dropping δ (clip), the constant normaliser (dr_grpo), clip-higher (dapo), the length
    normalisation of the sequence ratio (gspo), the stop-gradient (cispo) or the band (tr_mask)
    changes the value or the gradient on this batch, so the reference check would fail."""
    value, grad = _implementation(loss)
    bad_value, bad_grad = _reference(loss, mutant=True)
    same_grad = all(
        g == pytest.approx(b, abs=1e-6)
        for row, brow in zip(grad, bad_grad, strict=True)
        for g, b in zip(row, brow, strict=True)
    )
    assert not (value == pytest.approx(bad_value, abs=1e-6) and same_grad)


def test_the_flags_mark_tokens_without_a_policy_gradient():
    logp, behaviour, mask, adv = _tensors()
    ratio = importance_ratio(logp, behaviour)
    _, clipped = dapo_token_loss(ratio, adv, 0.2, 0.28)
    assert clipped.tolist() == [[False, False, False], [False, True, False]]  # ρ=0.05, A<0
    _, outside = trust_region_token_loss(ratio, adv, 0.125, 8.0)
    assert outside.tolist() == [[False, False, False], [False, True, False]]
    _, weight_clipped = cispo_token_loss(logp, ratio, adv, 0.2, 0.2)
    assert weight_clipped.tolist() == [[True, False, False], [True, True, False]]
    _, seq_clipped = gspo_token_loss(logp, behaviour, adv, mask, 0.2, 0.2)
    assert seq_clipped.tolist() == [[False] * 3, [True] * 3]
    _, clip_flag = clipped_token_loss(ratio, adv)
    assert clip_flag.tolist() == [[True, False, False], [False, True, False]]  # ρ=1.25 > 1.2


@pytest.mark.parametrize(
    ("kind", "mutant"),
    [("k1", lambda d: d), ("k3", lambda d: math.exp(d) - d), ("squared", lambda d: d * d)],
)
def test_kl_estimators_value_and_gradient(kind, mutant):
    ref = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    logp = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64, requires_grad=True)
    d = [r - p for r, p in zip(ref.tolist(), logp.tolist(), strict=True)]  # ref − logp
    value = {
        "k1": [-x for x in d],
        "k3": [math.exp(x) - x - 1 for x in d],
        "squared": [x * x / 2 for x in d],
    }[kind]
    grad = {  # d/dlogp = −d/dd
        "k1": [1.0] * 3,
        "k3": [-(math.exp(x) - 1) for x in d],
        "squared": [-x for x in d],
    }[kind]
    out = kl_penalty(kind, logp, ref)
    out.sum().backward()
    assert out.tolist() == pytest.approx(value)
    assert logp.grad.tolist() == pytest.approx(grad)
    assert [mutant(x) for x in d] != pytest.approx(value)  # one term off would be caught
    assert kl_penalty("none", logp, ref).tolist() == [0.0, 0.0, 0.0]


def test_corrections_by_hand():
    # trainer (old) vs behaviour log-ratios: r = 3, 0.9, pad | 0.25, 1.1, 1.0
    behaviour = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    log_r = torch.tensor(
        [[math.log(3.0), math.log(0.9), 5.0], [math.log(0.25), math.log(1.1), 0.0]]
    )
    old = behaviour + log_r
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kw = {"cap": 2.0, "band": (0.5, 2.0)}
    w, flag = correction_weights("none", old, behaviour, mask, **kw)
    assert w.tolist() == [[1.0] * 3] * 2 and not flag.any()
    w, flag = correction_weights("tis_token", old, behaviour, mask, **kw)
    assert w[:, :2].tolist() == [pytest.approx([2.0, 0.9]), pytest.approx([0.25, 1.1])]
    assert flag[:, :2].tolist() == [[True, False], [False, False]]
    # sequence ratio: the product over loss tokens (the padded 5.0 does not count): 2.7, 0.275
    w, flag = correction_weights("tis_sequence", old, behaviour, mask, **kw)
    assert w.tolist() == [pytest.approx([2.0] * 3), pytest.approx([0.275] * 3)]
    assert flag.tolist() == [[True] * 3, [False] * 3]
    w, flag = correction_weights("mask_token", old, behaviour, mask, **kw)
    assert w[:, :2].tolist() == [[0.0, 1.0], [0.0, 1.0]]
    w, flag = correction_weights("mask_sequence", old, behaviour, mask, **kw)
    assert w.tolist() == [[0.0] * 3, [0.0] * 3]  # 2.7 and 0.275 both leave [0.5, 2]
    w, _ = correction_weights("mask_sequence", old, behaviour, mask, cap=2.0, band=(0.2, 3.0))
    assert w.tolist() == [[1.0] * 3, [1.0] * 3]
    kl = mismatch_kl(old, behaviour)
    assert kl[0, 0].item() == pytest.approx(3.0 - 1.0 - math.log(3.0))
    assert kl[1, 2].item() == 0.0 and (kl >= 0).all()


def test_bad_loss_settings_fail_at_start_naming_the_key():
    cases = [
        (["rl.loss='ppo'"], "'rl.loss'"),
        (["rl.correction='is'"], "'rl.correction'"),
        (["rl.kl='k2'"], "'rl.kl'"),
        (["rl.correction='mask_token'", "rl.correction_low=3.0"], "rl.correction_low"),
        (["rl.tr_low=9.0"], "rl.tr_low"),
        (["rl.loss='tr_mask'", "rl.correction='tis_token'"], "rl.correction=tis_token"),
    ]
    for overrides, key in cases:
        with pytest.raises(ConfigError, match=key) as err:
            load_config([], overrides)
        assert "\n" not in str(err.value)
    config = load_config([], ["rl.loss='dr_grpo'"])
    assert config.rl.advantage_mode == "mean"  # Dr. GRPO: no std division
    assert load_config([], []).rl.advantage_mode == "std"


def test_corrections_tighten_with_each_samples_age():
    # r = 1.8, 1.1, 1.3 on both rows; row 0 is fresh (age 0), row 1 is older
    behaviour = torch.zeros((2, 3))
    old = torch.log(torch.tensor([[1.8, 1.1, 1.3], [1.8, 1.1, 1.3]]))
    mask = torch.ones((2, 3))
    kw = {"cap": 2.0, "band": (0.5, 2.0), "decay": 0.5}
    # tis, age 1: cap 2^0.5 = 1.414 truncates the 1.8 that the fresh row keeps
    w, flag = correction_weights(
        "tis_token", old, behaviour, mask, **kw, age=torch.tensor([[0.0], [1.0]])
    )
    assert w.tolist() == [pytest.approx([1.8, 1.1, 1.3]), pytest.approx([2**0.5, 1.1, 1.3])]
    assert flag.tolist() == [[False] * 3, [True, False, False]]
    # mask, age 2: band [0.5^0.25, 2^0.25] = [0.841, 1.189] keeps 1.1 only
    w, flag = correction_weights(
        "mask_token", old, behaviour, mask, **kw, age=torch.tensor([[0.0], [2.0]])
    )
    assert w.tolist() == [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    assert flag.tolist() == [[False] * 3, [True, False, True]]
    # the sequence ratio 1.8·1.1·1.3 = 2.574 against cap 2^0.25 = 1.189 at age 2
    w, _ = correction_weights(
        "tis_sequence", old, behaviour, mask, **kw, age=torch.tensor([[0.0], [2.0]])
    )
    assert w.tolist() == [pytest.approx([2.0] * 3), pytest.approx([2**0.25] * 3)]
    # decay 1 (the default): age changes nothing; decay 0: an aged sample gets no weight above 1
    aged = torch.tensor([[3.0], [3.0]])
    same, _ = correction_weights("tis_token", old, behaviour, mask, cap=2.0, age=aged)
    assert same.tolist() == [pytest.approx([1.8, 1.1, 1.3])] * 2
    zero, _ = correction_weights("tis_token", old, behaviour, mask, cap=2.0, age=aged, decay=0.0)
    assert zero.tolist() == [[1.0, 1.0, 1.0]] * 2
