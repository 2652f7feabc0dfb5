"""Pure pieces of the pool: the task draw, lease sizing, throughput estimate, the checks of a
submission's samples, and the rollout store on a local directory and an fsspec URL (spot-check
sampling: tests/test_pool_spotcheck.py)."""

import hashlib

import pytest

from swarmrl.pool.flow.samples import check_samples
from swarmrl.pool.flow.scheduling import draw_tasks, lease_size, unit_seed, update_throughput
from swarmrl.pool.rejections import Invalid
from swarmrl.pool.state.store import RolloutStore
from swarmrl.protocol.pool import PoolSpec, Sample, SamplingParams, Submission, WorkUnit
from swarmrl.testing.pool_nodes import synthetic_samples


def test_task_draw_is_the_documented_hash_and_depends_on_secret_node_and_counter():
    digest = hashlib.sha256(b"swarmrl-seed-v1:task:7:5e:abc:3:0").digest()
    want = (int.from_bytes(digest[:8], "big") >> 1) % 1000
    assert draw_tasks(7, "5e", "abc", 3, 1, 1000) == [want]
    a = draw_tasks(7, "5e", "abc", 3, 50, 1000)
    assert a == draw_tasks(7, "5e", "abc", 3, 50, 1000)  # anyone with the secret can recompute it
    assert a != draw_tasks(7, "5f", "abc", 3, 50, 1000)  # without it, nobody can
    assert a != draw_tasks(7, "5e", "abd", 3, 50, 1000)  # another node gets other tasks
    assert a != draw_tasks(7, "5e", "abc", 4, 50, 1000)  # the next lease gets other tasks
    assert a != draw_tasks(8, "5e", "abc", 3, 50, 1000)  # another pool seed too
    assert all(0 <= t < 1000 for t in a) and len(set(a)) > 40
    seed = unit_seed(7, "5e", "abc", 3)
    assert 0 <= seed < 2**63 and seed != unit_seed(7, "5e", "abc", 4)
    assert seed != unit_seed(7, "5f", "abc", 3)
    with pytest.raises(ValueError):
        draw_tasks(7, "5e", "abc", 0, 1, 0)


def test_lease_size_follows_measured_throughput_within_bounds():
    # 100 tok/s × 30 s / (4 samples × 25 tokens) = 30 tasks, clamped to [1, 16]
    assert lease_size(100.0, 30.0, 4, 25, 1, 16) == 16
    assert lease_size(10.0, 30.0, 4, 25, 1, 16) == 3
    assert lease_size(0.5, 30.0, 4, 25, 2, 16) == 2
    assert lease_size(None, 30.0, 4, 25, 2, 16) == 2
    assert lease_size(float("nan"), 30.0, 4, 25, 2, 16) == 2
    assert update_throughput(None, 100, 2.0) == 50.0
    assert update_throughput(50.0, 100, 1.0) == pytest.approx(0.7 * 50 + 0.3 * 100)


@pytest.mark.parametrize("where", ["dir", "memory"])
def test_rollout_store_roundtrip_is_exact(tmp_path, where):
    url = str(tmp_path / "store") if where == "dir" else f"memory://store-{tmp_path.name}"
    store = RolloutStore(url)
    samples = [
        Sample(
            task_index=3,
            prompt_tokens=[1, 2],
            output_tokens=[5, 6, 7],
            logprobs=[-0.1, -1e-9, -23.456789012345],
            finish_reason="eos",
            policy_version=4,
            proof={"chunks": ["AAE="], "n": 1},
        ),
        Sample(
            task_index=3,
            prompt_tokens=[1, 2],
            output_tokens=[],
            logprobs=[],
            finish_reason="length",
            policy_version=4,
            proof="00ff",
        ),
        Sample(
            task_index=9,
            prompt_tokens=[],
            output_tokens=[2**31 - 1],
            logprobs=[0.0],
            finish_reason="stop",
            policy_version=5,
            proof=None,
        ),
    ]
    store.put_samples("p/s1.parquet", samples)
    assert store.get_samples("p/s1.parquet") == samples
    # a submission is stored as its signed body alone; its samples are read from it, exactly
    body = Submission(lease_id="a" * 32, samples=samples).model_dump_json().encode()
    store.put_request("p/s2.parquet", body)
    assert store.get_request("p/s2.parquet") == body
    assert store.get_samples("p/s2.parquet") == samples
    store.put_request("p/s3.parquet", b'{"lease_id": "' + b"a" * 32 + b'", "samples": [{}]}')
    with pytest.raises(ValueError, match="task_index"):
        store.get_samples("p/s3.parquet")
    store.delete("p/s2.parquet")
    with pytest.raises(FileNotFoundError):
        store.get_samples("p/s2.parquet")
    assert store.get_behaviour("p/s1.parquet") is None
    store.put_behaviour("p/s1.parquet", [[-0.5, -0.25, -1 / 3], [], [-2.0]])
    assert store.get_behaviour("p/s1.parquet") == [[-0.5, -0.25, -1 / 3], [], [-2.0]]
    store.delete("p/s1.parquet")
    with pytest.raises(FileNotFoundError):
        store.get_samples("p/s1.parquet")


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "field, values, says",
    [
        ("logprobs", [-1.0, NAN, -2.0], "finite"),
        ("logprobs", [NAN, -1.0, -2.0], "finite"),  # first: max() alone would skip it
        ("logprobs", [-1.0, -INF, -2.0], "finite"),
        ("logprobs", [-1.0, 1e-300, -2.0], "≤ 0"),
        ("output_tokens", [1, -1, 2], "token ids"),
        ("output_tokens", [1, 2**31, 2], "token ids"),
        ("prompt_tokens", [-5], "token ids"),
        (None, None, None),  # the well-formed sample, for contrast
        ("logprobs", [-1e308, -1e308, -0.0], None),  # finite: their sum overflows, no matter
    ],
)
def test_check_samples_refuses_bad_values_wherever_they_sit(field, values, says):
    spec = PoolSpec(
        pool_id="p", owner_key="a" * 64, task_count=4, sampling=SamplingParams(max_new_tokens=3)
    )
    work = WorkUnit(
        lease_id="l",
        pool_id="p",
        node_id="n",
        task_indices=[1],
        samples_per_task=1,
        sampling=spec.sampling,
        seed=7,
        min_version=0,
        deadline=0.0,
        origin_node_id="n",
        origin_counter=0,
        assignment_epoch=0,
    )
    sample = synthetic_samples(work, 0)[0]
    if field is not None:
        sample = sample.model_copy(update={field: values})
    if says is None:
        assert check_samples(spec, work, [sample], 0, 10_000) == 3
        return
    with pytest.raises(Invalid, match=says):
        check_samples(spec, work, [sample], 0, 10_000)
