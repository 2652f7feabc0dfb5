"""Several claimed submissions are replayed together and each gets the verdict it gets alone."""

from __future__ import annotations

import pytest

from swarmrl.envs import build_env
from swarmrl.errors import WaitTimeout
from swarmrl.roles.validator.judge import judge, judge_many
from swarmrl.roles.worker.rollouts import corrupt_weights
from swarmrl.toploc import prefill
from test_swarm_roles import _submit


def _units(tiny_arith):
    _, _, _, model = tiny_arith
    honest, versions, config = _submit(tiny_arith, tasks=(5, 17))
    forged, _, _ = _submit(tiny_arith, corrupt_weights(model.state_dict(), seed=1), tasks=(9, 11))
    other, _, _ = _submit(tiny_arith, tasks=(3, 8))
    units = [
        honest,
        forged.model_copy(update={"submission_id": "s2"}),
        other.model_copy(update={"submission_id": "s3"}),
    ]
    return units, versions, config


def test_units_judged_together_get_the_verdicts_they_get_alone(tiny_arith):
    units, versions, config = _units(tiny_arith)
    env = build_env(config.env)
    together = judge_many(units, env, versions, config.toploc)
    alone = [judge(u, env, versions, config.toploc) for u in units]
    assert [j.verdict.submission_id for j in together] == ["s1", "s2", "s3"]
    assert [j.verdict.accept for j in together] == [True, False, True]
    assert [j.verdict.accept for j in alone] == [True, False, True]
    assert together[1].verdict.severity == "hard"
    assert together[1].verdict.reasons == alone[1].verdict.reasons  # its own samples only
    for t, a in zip(together, alone, strict=True):
        assert t.rewards == a.rewards
        assert t.verdict.measured_tokens == a.verdict.measured_tokens
        got, want = t.verdict.behaviour_logprobs or [], a.verdict.behaviour_logprobs or []
        assert len(got) == len(want) == (6 if t.verdict.accept else 0)
        for bt, ba in zip(got, want, strict=True):
            assert bt == pytest.approx(ba, abs=1e-4)  # one padded batch against three


def test_units_at_one_version_share_one_batched_prefill(tiny_arith, monkeypatch):
    units, versions, config = _units(tiny_arith)
    batches: list[int] = []
    original = prefill._prefill_batch

    def counted(engine, pairs):
        batches.append(len(pairs))
        return original(engine, pairs)

    monkeypatch.setattr(prefill, "_prefill_batch", counted)
    judge_many(units, build_env(config.env), versions, config.toploc)
    assert batches == [18]  # 3 units × 2 tasks × 3 samples, one forward
    batches.clear()
    for unit in units:
        judge(unit, build_env(config.env), versions, config.toploc)
    assert batches == [6, 6, 6]


def test_a_unit_on_the_wrong_tasks_is_rejected_without_holding_up_the_others(tiny_arith):
    units, versions, config = _units(tiny_arith)
    swapped = [*units[0].samples[3:], *units[0].samples[:3]]
    units[0] = units[0].model_copy(update={"samples": swapped})
    results = judge_many(units, build_env(config.env), versions, config.toploc)
    assert "where the lease assigned 5" in results[0].verdict.reasons[0]
    assert [j.verdict.accept for j in results] == [False, False, True]


def test_a_unit_whose_version_cannot_be_fetched_now_is_deferred_and_the_others_judged(
    tiny_arith,
):
    """The weights of one unit's version cannot be had now (the fetch's retries gave up): that
    unit gets no verdict (it is claimed again later; before, the error ended the validator),
    and the units of other versions get theirs."""
    units, versions, config = _units(tiny_arith)
    later = [s.model_copy(update={"policy_version": 1}) for s in units[2].samples]
    units[2] = units[2].model_copy(update={"samples": later})

    def version_of(version: int):
        if version == 1:
            raise WaitTimeout("fetch policy v1: peer unreachable for 300 s")
        return versions(version)

    results = judge_many(units, build_env(config.env), version_of, config.toploc)
    assert [j.verdict.accept for j in results[:2]] == [True, False]
    assert results[2].verdict is None and "policy v1" in results[2].failure
