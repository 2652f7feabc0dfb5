import copy
import json
import subprocess
import sys

import pytest
import torch

from swarmrl.config import load_config
from swarmrl.config.model import TinyModelConfig
from swarmrl.config.rl import RLConfig
from swarmrl.envs import Task
from swarmrl.model import build_char_tokenizer, create_tiny_model
from swarmrl.rl import token_logprobs
from swarmrl.trainer.batch import Completion, Group, collate
from swarmrl.trainer.colocated import run_colocated
from swarmrl.trainer.loop import ROW_KEYS, Hooks, rollout_metrics
from swarmrl.trainer.source import StepRollouts
from swarmrl.trainer.step import StepAccumulator, make_optimizer, policy_step

TASK = Task(problem_id=0, split="train", index=0, prompt="1+1=", answer="2")


def _completion(prompt, output, reward):
    return Completion(prompt, output, [-0.5] * len(output), reward)


def test_collate_places_tokens_masks_and_advantages():
    groups = [
        Group(TASK, [_completion([1, 5], [6, 2], 1.0), _completion([1, 5], [7], 0.0)]),
        Group(TASK, [_completion([1, 5, 5], [2], 0.0), _completion([1, 5, 5], [6, 6, 2], 0.0)]),
    ]
    batch = collate(groups, pad_id=0, advantage="std")
    assert batch.input_ids.tolist() == [
        [1, 5, 6, 2, 0, 0],
        [1, 5, 7, 0, 0, 0],
        [1, 5, 5, 2, 0, 0],
        [1, 5, 5, 6, 6, 2],
    ]
    # position j predicts token j+1: output tokens start right after the prompt
    assert batch.loss_mask.tolist() == [
        [0, 1, 1, 0, 0],
        [0, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 1],
    ]
    assert batch.behaviour_logp[0].tolist() == [0, -0.5, -0.5, 0, 0]
    assert batch.advantages[:, 0].tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    assert batch.loss_tokens == 7
    with pytest.raises(ValueError, match="same size"):
        collate([groups[0], Group(TASK, groups[1].completions[:1])], 0)


@pytest.fixture()
def tiny():
    torch.manual_seed(0)
    tok = build_char_tokenizer("0123456789+=")
    model = create_tiny_model(
        TinyModelConfig(
            hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, initializer_range=0.02
        ),
        tok,
    )
    return model


def _on_policy_batch(model):
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
    batch.behaviour_logp = logp * batch.loss_mask  # the generating policy is the current one
    return batch


def test_policy_step_on_policy_loss_and_micro_batches_agree(tiny):
    rl = RLConfig(lr=1e-2)
    batch = _on_policy_batch(tiny)
    expected = float(-(batch.advantages * batch.loss_mask).sum() / batch.loss_mask.sum())
    results = []
    for micro in (256, 1):
        model = copy.deepcopy(tiny)
        stats = policy_step(model, make_optimizer(model, rl), batch, rl, micro_batch=micro)
        assert stats.loss == pytest.approx(expected, abs=1e-5)  # ratio 1: ℓ = −A per token
        assert stats.clip_fraction == 0.0 and stats.grad_norm > 0 and stats.entropy > 0
        moved = [
            not torch.equal(p, q)
            for p, q in zip(model.parameters(), tiny.parameters(), strict=True)
        ]
        assert any(moved)
        results.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    # the same clipped gradient whether the batch is split or not (global token normalization)
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_a_step_fed_its_batch_in_parts_equals_one_step_on_the_whole(tiny):
    """The trainer computes the gradients of a batch's first groups while the rest is still
    coming: the step is the same as one taken on the whole batch."""
    rl = RLConfig(lr=1e-2, kl_coef=0.1)
    batch = _on_policy_batch(tiny)
    batch.behaviour_logp = batch.behaviour_logp - 0.05 * batch.loss_mask  # ratios ≠ 1
    reference = copy.deepcopy(tiny)
    whole, parts = copy.deepcopy(tiny), copy.deepcopy(tiny)
    expected = policy_step(whole, make_optimizer(whole, rl), batch, rl, reference, micro_batch=4)
    step = StepAccumulator(parts, make_optimizer(parts, rl), rl, reference, micro_batch=4)
    step.add(batch.rows(0, 3))  # the first group (3 completions each)
    step.add(batch.rows(3, 9))  # the other two, later
    got = step.finish()
    assert got.loss_tokens == expected.loss_tokens == batch.loss_tokens
    for key in ("loss", "clip_fraction", "grad_norm", "entropy", "kl"):
        assert getattr(got, key) == pytest.approx(getattr(expected, key), rel=1e-5, abs=1e-7)
    for p, q in zip(parts.parameters(), whole.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
        # Adam moves a weight by about lr·g/|g| whatever |g|: rounding in a tiny g shows more
        assert torch.allclose(p, q, atol=1e-5)
    assert not all(
        torch.equal(p, q) for p, q in zip(parts.parameters(), tiny.parameters(), strict=True)
    )


def test_kl_term_is_zero_against_itself_and_grows_after_a_step(tiny):
    rl = RLConfig(lr=5e-2, kl_coef=0.5)
    batch = _on_policy_batch(tiny)
    reference = copy.deepcopy(tiny)
    optimizer = make_optimizer(tiny, rl)
    first = policy_step(tiny, optimizer, batch, rl, reference)
    assert first.kl == pytest.approx(0.0, abs=1e-7)
    second = policy_step(tiny, optimizer, batch, rl, reference)
    assert second.kl > 1e-6


def _small_run_config(tmp_path, *extra):
    return load_config(
        [],
        [
            'env.name="reverse"',
            "env.reverse_len=3",
            "model.tiny.hidden_size=32",
            "model.tiny.num_layers=1",
            "model.tiny.num_heads=2",
            "model.tiny.intermediate_size=64",
            "sft.steps=10",
            "sft.train_examples=64",
            "sft.batch_size=32",
            "rl.steps=3",
            "rl.prompts_per_step=4",
            "rl.group_size=4",
            "rl.online_filter=false",
            "rl.sampling.max_new_tokens=5",
            "eval.n=8",
            "eval.control=false",
            "run.threads=1",
            f"run.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
            *extra,
        ],
    )


def test_colocated_run_is_reproducible(tmp_path):
    config = _small_run_config(tmp_path, "eval.every=2")
    runs = []
    for _ in range(2):
        rows = []
        run = run_colocated(config, Hooks(on_step=rows.append))
        raw_rows = rows
        timings = ("rollout_s", "update_s", "tokens_per_s", "wall_time")
        runs.append(
            (
                [{k: v for k, v in r.items() if k not in timings} for r in rows],
                run.result.evals,
            )
        )
    assert runs[0] == runs[1]
    rows = runs[0][0]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert tuple(raw_rows[0]) == ROW_KEYS  # the keys a swarm run's rows have too
    assert [e["step"] for e in run.result.during] == [2]  # eval.every=2 of 3 steps
    assert all(r["staleness"] == 0.0 for r in rows)  # colocated rollouts are always fresh
    assert [r["policy_version"] for r in rows] == [0, 1, 2]
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in rows)
    assert 0.0 < rows[0]["reward_mean"] < 1.0  # partial credit: a real signal to learn from


def test_workers_in_a_lower_dtype_than_the_trainer_are_a_measured_mismatch(tmp_path):
    """inference.dtype = bfloat16 under a float32 trainer: the generator samples in bfloat16, so
    even the first, on-policy step sees the engines differ; in the trainer's own dtype only
    rounding is left. rl.correction acts on that mismatch."""
    from swarmrl.config import SwarmConfig

    assert SwarmConfig().engine_dtype == "float32"  # None follows the trainer's model.dtype
    assert SwarmConfig.model_validate({"model": {"dtype": "bfloat16"}}).engine_dtype == "bfloat16"

    def first_step(*extra: str) -> dict:
        rows: list[dict] = []
        config = _small_run_config(tmp_path, "rl.steps=1", *extra)
        run_colocated(config, Hooks(on_step=rows.append))
        return rows[0]

    same = first_step()
    lower = first_step("inference.dtype=bfloat16")
    assert same["mismatch_kl"] < 1e-7
    assert lower["mismatch_kl"] > max(1e-6, 100 * same["mismatch_kl"]), (lower, same)
    masked = first_step("inference.dtype=bfloat16", "rl.correction=mask_token",
                        "rl.correction_low=0.999", "rl.correction_high=1.001")  # fmt: skip
    assert 0.0 < masked["corrected_fraction"]
    assert first_step("rl.correction=mask_token", "rl.correction_low=0.999",
                      "rl.correction_high=1.001")["corrected_fraction"] == 0.0  # fmt: skip


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_cli_invalid_config_value_is_one_line(tmp_path):
    proc = _cli(
        "run",
        "configs/arith.toml",
        "--colocated",
        "--set",
        "rl.lr=-1",
        cwd=str(__import__("pathlib").Path(__file__).parents[1]),
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "'rl.lr'" in proc.stderr and "greater than 0" in proc.stderr


@pytest.mark.slow
def test_cli_missing_model_is_one_line(tmp_path):
    proc = _cli("eval", "--model", str(tmp_path / "no-such-model"), cwd=str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "no-such-model" in proc.stderr


@pytest.mark.slow
def test_cli_malformed_dataset_is_one_line_naming_the_row(tmp_path):
    pytest.importorskip("datasets", reason="needs the tasks extra: pip install -e '.[tasks]'")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    proc = _cli(
        "eval",
        "--set",
        'env.name="math"',
        "--set",
        f"env.dataset={json.dumps(str(bad))}",
        cwd=str(tmp_path),
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert f"{bad} row 2" in proc.stderr


def test_eval_and_filter_verbs_with_a_saved_model(tmp_path, capsys):
    from swarmrl.model import save_policy
    from swarmrl.trainer.cli import main

    torch.manual_seed(0)
    tok = build_char_tokenizer("0123456789+=")
    model = create_tiny_model(
        TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), tok
    )
    model_dir = save_policy(model, tok, tmp_path / "m")
    common = ["--set", "env.digits=1", "--set", "eval.n=10", "--set", "run.threads=1"]
    assert main("eval", ["--model", str(model_dir), *common]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["n"] == 10 and 0.0 <= result["accuracy"] <= 1.0

    out = tmp_path / "kept.jsonl"
    args = ["--model", str(model_dir), "--out", str(out), "--n", "12", "--samples", "2", *common]
    assert main("filter", [*args, "--lo", "0", "--hi", "1"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12 and {"problem", "answer", "pass_rate"} <= set(rows[0])
    assert main("filter", [*args, "--lo", "0.6", "--hi", "1"]) == 0
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["problem"] for r in kept] == [r["problem"] for r in rows if r["pass_rate"] >= 0.6]


def test_sft_warm_starts_a_given_model_and_caches_it(tmp_path):
    """model.path + model.warm_start: the given model is fine-tuned on the environment's
    demonstrations once, cached by digest, reused by the next run; without the flag it is
    the starting policy as given."""
    from swarmrl.config import EMBEDDED_DEFAULT
    from swarmrl.envs import build_env
    from swarmrl.model import load_policy, save_policy
    from swarmrl.trainer.warmstart import ensure_warm_start

    base = load_config([EMBEDDED_DEFAULT], ["env.digits=2"])
    env = build_env(base.env)
    tokenizer = build_char_tokenizer(env.alphabet)
    torch.manual_seed(0)
    tiny = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    given = save_policy(create_tiny_model(tiny, tokenizer), tokenizer, tmp_path / "given")
    common = [
        "env.digits=2", f"model.path={json.dumps(str(given))}", "sft.steps=3",
        "sft.train_examples=64", "sft.batch_size=8",
        f"run.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
    ]  # fmt: skip
    as_given = ensure_warm_start(load_config([EMBEDDED_DEFAULT], common), env)
    assert as_given.path == given and as_given.steps == 0

    config = load_config([EMBEDDED_DEFAULT], [*common, "model.warm_start=true"])
    first = ensure_warm_start(config, env)
    assert not first.cached and first.steps == 3 and first.path != given
    assert str(first.path).startswith(str(tmp_path / "cache"))
    tuned, _ = load_policy(first.path)
    original, _ = load_policy(given)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(tuned.state_dict().values(), original.state_dict().values(), strict=True)
    )
    again = ensure_warm_start(config, env)
    assert again.cached and again.path == first.path


def test_batched_prompt_encoding_gives_the_one_layout_ids():
    from swarmrl.envs import ArithEnv
    from swarmrl.model.prompts import encode_prompt, encode_prompts
    from swarmrl.model.tokenizer import build_char_tokenizer
    from swarmrl.trainer.sft import encode_examples

    env = ArithEnv(3)
    tokenizer = build_char_tokenizer(env.alphabet)
    tasks = env.first("train", 20)
    texts = ["12+3=", "", "7+7="]
    assert encode_prompts(tokenizer, tasks) == [encode_prompt(tokenizer, t) for t in tasks]
    assert encode_prompts(tokenizer, texts) == [encode_prompt(tokenizer, t) for t in texts]
    assert encode_prompts(tokenizer, []) == []
    data = encode_examples(tokenizer, tasks, [t.answer for t in tasks])
    for row, task in zip(data.input_ids.tolist(), tasks, strict=True):
        ids = encode_prompt(tokenizer, task) + tokenizer.encode(task.answer)
        assert row[: len(ids) + 1] == [*ids, tokenizer.eos_token_id]


def test_collate_gives_each_row_its_age_and_the_row_logs_the_ages():
    def aged(version):
        return Completion([1, 5], [6, 2], [-0.5, -0.5], 1.0, policy_version=version)

    groups = [Group(TASK, [aged(7), aged(7)]), Group(TASK, [aged(6), aged(4)])]
    batch = collate(groups, 0, policy_version=7)
    assert batch.age.flatten().tolist() == [0.0, 0.0, 1.0, 3.0]
    assert batch.rows(2, 4).age.flatten().tolist() == [1.0, 3.0]
    assert collate(groups, 0).age is None  # no version: no ages (the correction takes 0)
    row = rollout_metrics(StepRollouts(groups), 7)
    assert row["staleness"] == 1.0 and row["staleness_max"] == 3
    assert row["staleness_shares"] == {"0": 0.5, "1": 0.25, "3": 0.25}
    assert rollout_metrics(StepRollouts([]), 7)["staleness_shares"] == {}
