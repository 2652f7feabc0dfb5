"""LoRA: adapters trained on a frozen base, versions that carry the adapter only, engines and
the verifier running base + adapter, and the refusals (bad targets, peft missing, an adapter
for another base, a corrupt adapter)."""

from __future__ import annotations

import copy
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarmrl.config import SwarmConfig
from swarmrl.config.model import LoraConfig, TinyModelConfig
from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.config.toploc import ToplocConfig
from swarmrl.envs import build_env
from swarmrl.errors import AdapterMismatch, ConfigError, CorruptData
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.lora import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    Adapter,
    adapter_tensors,
    merge_factors,
    merge_peft_state,
)
from swarmrl.model.factory import create_tiny_model
from swarmrl.model.io import save_policy
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.protocol import SamplingParams
from swarmrl.shardcast import Publisher, WeightClient, store
from swarmrl.testing import cheats as attacks
from swarmrl.testing.shardcast import serve_store
from swarmrl.toploc.calibrate import measure, recommend
from swarmrl.toploc.verify import Verifier
from swarmrl.trainer import lora as lora_training
from swarmrl.trainer.batch import Completion, Group
from swarmrl.trainer.checkpoint import Checkpointer
from swarmrl.trainer.learner import Learner
from swarmrl.trainer.parallel import Parallel
from swarmrl.trainer.step import make_optimizer

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parent.parent
TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)
KEY = KeyPair.from_seed(b"\x0b" * 32)
SHARD = 16 * 1024
CFG = ShardcastConfig(shard_size_bytes=SHARD, request_timeout_s=10, long_poll_timeout_s=2)


def _tokenizer():
    return build_char_tokenizer("abcdefghijklmnop:")


def _adapter_version(base, tokenizer, out: Path, seed: int, versions=None):
    """A version directory of ``base`` with a LoRA adapter whose B factors are random."""
    versions = versions or lora_training.AdapterVersions(base, tokenizer, LORA)
    wrapped = lora_training.wrap(copy.deepcopy(base), LORA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    wrapped.eval()
    path = versions.save(adapter_tensors(wrapped.state_dict()), wrapped.peft_config["default"], out)
    return wrapped, versions, path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    base = create_tiny_model(TINY, tokenizer)
    root = tmp_path_factory.mktemp("lora")
    wrapped, versions, path = _adapter_version(base, tokenizer, root / "v1", seed=1)
    yield {
        "tokenizer": tokenizer,
        "base": base,
        "wrapped": wrapped,
        "versions": versions,
        "path": path,
        "root": root,
    }
    versions.close()
    torch.set_num_threads(previous)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_version_loads_as_its_base_with_the_adapter_merged(world):
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    engine = TorchEngine.from_checkpoint(world["path"])
    want = _logits(world["wrapped"], ids)  # peft's own forward: W x + s · B A x
    assert torch.allclose(_logits(engine.model, ids), want, atol=1e-5)
    assert not torch.allclose(_logits(world["base"], ids), want, atol=1e-3)  # it matters
    merged = merge_peft_state(world["wrapped"].state_dict(), LORA.alpha / LORA.rank)
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, merged[name]), name
    # the base files are the same bytes in every version (shardcast sends them once)
    base_dir = world["versions"].base_dir
    for item in base_dir.iterdir():
        assert (world["path"] / item.name).read_bytes() == item.read_bytes()
    # an engine started on the base alone swaps to the LoRA version in place
    swapped = TorchEngine.from_checkpoint(base_dir)
    swapped.load_checkpoint(world["path"])
    assert torch.allclose(_logits(swapped.model, ids), want, atol=1e-5)


def test_a_step_trains_the_adapters_only(world):
    wrapped = lora_training.wrap(copy.deepcopy(world["base"]), LORA)
    optimizer = make_optimizer(wrapped, SwarmConfig().rl)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = {name for name, p in wrapped.named_parameters() if id(p) in held}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(LORA.target_modules) * TINY.num_layers
    before = {k: v.clone() for k, v in wrapped.state_dict().items()}
    wrapped.train()
    loss = wrapped(input_ids=torch.tensor([[3, 4, 5, 6]]), labels=torch.tensor([[3, 4, 5, 6]]))
    loss.loss.backward()
    optimizer.step()
    for name, value in wrapped.state_dict().items():
        changed = not torch.equal(value, before[name])
        assert changed == (".lora_B." in name), name  # A's gradient is 0 while B is 0


def _groups(tokenizer, env, n: int = 2) -> list[Group]:
    groups = []
    for i in range(n):
        task = env.task("train", i)
        group = Group(task)
        for j, reward in enumerate([1.0, 0.0]):
            prompt = tokenizer.encode(task.prompt)
            output = tokenizer.encode(str(j))
            group.completions.append(
                Completion(prompt, output, [-1.0] * len(output), reward, 0, reward == 1.0)
            )
        groups.append(group)
    return groups


def test_the_learner_trains_adapters_and_publishes_the_merged_policy(tmp_path):
    tokenizer = build_char_tokenizer("0123456789+= ")
    start_model = create_tiny_model(TINY, tokenizer)
    start = save_policy(start_model, tokenizer, tmp_path / "start")
    config = SwarmConfig.model_validate(
        {
            "model": {"path": str(start), "lora": {"enabled": True, "rank": 4, "alpha": 8.0}},
            "env": {"name": "arith", "digits": 1},
            "run": {"cache_dir": str(tmp_path / "cache"), "device": "cpu"},
            "rl": {"lr": 1e-2},
        }
    )
    env = build_env(config.env)
    learner = Learner(config, env)
    try:
        tokenizer = learner.tokenizer
        learner.step(_groups(tokenizer, env))
        learner.step(_groups(tokenizer, env))
        held = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
        names = {n for n, p in learner.trained.named_parameters() if id(p) in held}
        assert len(names) == len(held) == 2 * len(LORA.target_modules) * TINY.num_layers
        assert all(".lora_A." in n or ".lora_B." in n for n in names)
        version = learner.save_version(tmp_path / "v2")
        assert (version / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file()
        loaded = TorchEngine.from_checkpoint(version).model.state_dict()
        base = start_model.state_dict()
        moved = 0
        for name, value in learner.policy.state_dict().items():
            assert torch.allclose(loaded[name], value, atol=1e-6), name
            moved += not torch.equal(value, base[name])
        assert moved == len(LORA.target_modules) * TINY.num_layers  # the targets, merged
    finally:
        learner.close()


def test_a_lora_checkpoint_resumes_exactly(tmp_path):
    """Adapters and their optimizer state go through a trainer checkpoint and come back."""
    tokenizer = build_char_tokenizer("0123456789+= ")
    start = save_policy(create_tiny_model(TINY, tokenizer), tokenizer, tmp_path / "start")
    config = SwarmConfig.model_validate(
        {
            "model": {"path": str(start), "lora": {"enabled": True, "rank": 4, "alpha": 8.0}},
            "env": {"name": "arith", "digits": 1},
            "run": {"cache_dir": str(tmp_path / "cache"), "device": "cpu"},
            "rl": {"lr": 1e-2},
        }
    )
    env = build_env(config.env)
    checkpoints = Checkpointer(tmp_path / "ckpt", config, Parallel())
    first = Learner(config, env)
    first.step(_groups(first.tokenizer, env))
    first.save_checkpoint(checkpoints, 1, None)
    first.step(_groups(first.tokenizer, env))
    straight = {k: v.clone() for k, v in first.policy.state_dict().items()}
    first.close()
    second = Learner(config, env)
    second.resume(checkpoints, checkpoints.latest())
    assert second.version == 1
    second.step(_groups(second.tokenizer, env))
    for name, value in second.policy.state_dict().items():
        assert torch.equal(value, straight[name]), name
    second.close()


def test_a_missing_target_module_is_one_line_at_start_and_writes_nothing(tmp_path):
    config = SwarmConfig.model_validate(
        {"model": {"lora": {"enabled": True, "target_modules": ["q_proj", "qkv"]}}}
    )
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['qkv'\]") as err:
        lora_training.check_lora(config)
    assert "\n" not in str(err.value)
    # the whole command: exit 2, one line, no run directory and no warm start written
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarmrl.cli",
            "run",
            str(ROOT / "configs" / "arith.toml"),
            "--colocated",
            "--set",
            "model.lora.enabled=true",
            "--set",
            'model.lora.target_modules=["q_proj","qkv"]',
            "--set",
            f"run.run_dir={tmp_path / 'runs'}",
            "--set",
            f"run.cache_dir={tmp_path / 'cache'}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "model.lora.target_modules" in done.stderr and "qkv" in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "cache").exists()  # no warm start was trained or cached


def test_lora_without_peft_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft → ImportError
    config = SwarmConfig.model_validate({"model": {"lora": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"pip install 'swarmrl\[lora\]'") as err:
        lora_training.check_lora(config)
    assert "\n" not in str(err.value)
    lora_training.check_lora(SwarmConfig())  # LoRA off: peft is not needed


def test_an_adapter_for_another_base_is_refused(world, tmp_path):
    torch.manual_seed(5)
    other = create_tiny_model(TINY, world["tokenizer"])  # same shapes, other weights
    elsewhere = save_policy(other, world["tokenizer"], tmp_path / "other")
    mixed = shutil.copytree(world["path"], tmp_path / "mixed")
    shutil.copyfile(elsewhere / "model.safetensors", mixed / "model.safetensors")
    with pytest.raises(AdapterMismatch, match="trained on another base"):
        TorchEngine.from_checkpoint(mixed)
    engine = TorchEngine.from_checkpoint(world["path"])
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(AdapterMismatch):
        engine.load_checkpoint(mixed)
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
    # an adapter whose factors do not fit the base's shapes
    wide = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}
    bad = Adapter(2.0, {next(iter(wide)): (torch.zeros(4, 32), torch.zeros(64, 4))}, {})
    with pytest.raises(AdapterMismatch, match="A \\(4, 32\\)"):
        merge_factors(wide, bad)
    absent = Adapter(2.0, {"model.nothing.weight": (torch.zeros(4, 64), torch.zeros(64, 4))}, {})
    with pytest.raises(AdapterMismatch, match="lacks"):
        merge_factors(wide, absent)


@pytest.mark.parametrize("damage", ["truncated", "garbage_config", "no_lora_B"])
def test_a_corrupt_adapter_is_refused(world, tmp_path, damage):
    bad = shutil.copytree(world["path"], tmp_path / "bad")
    folder = bad / ADAPTER_DIR
    if damage == "truncated":
        data = (folder / ADAPTER_WEIGHTS).read_bytes()
        (folder / ADAPTER_WEIGHTS).write_bytes(data[: len(data) // 2])
    elif damage == "garbage_config":
        (folder / "adapter_config.json").write_text("{not json")
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
        save_file({k: v for k, v in tensors.items() if "lora_B" not in k}, folder / ADAPTER_WEIGHTS)
    with pytest.raises(CorruptData, match="LoRA adapter"):
        TorchEngine.from_checkpoint(bad)


def test_shardcast_sends_the_adapter_only_and_refuses_a_corrupt_adapter_shard(world, tmp_path):
    tokenizer, base, versions = world["tokenizer"], world["base"], world["versions"]
    publisher = Publisher(tmp_path / "origin", KEY, CFG)
    adapters = {}
    for v in range(3):
        wrapped, _, path = _adapter_version(base, tokenizer, tmp_path / f"ck{v}", v, versions)
        adapters[v] = wrapped
        publisher.publish(path, v)
    origin = serve_store(tmp_path / "origin", CFG)
    try:
        client = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "client", CFG)
        client.fetch(0)
        full = client.last_report.network_bytes
        adapter_bytes = (tmp_path / "ck1" / ADAPTER_DIR / ADAPTER_WEIGHTS).stat().st_size
        for v in (1, 2):
            path = client.fetch(v)
            report = client.last_report
            assert "model.safetensors" in report.reused
            assert report.network_bytes <= adapter_bytes < full / 4
            engine = TorchEngine.from_checkpoint(path)
            ids = torch.tensor([[3, 4, 5]])
            assert torch.allclose(_logits(engine.model, ids), _logits(adapters[v], ids), atol=1e-5)
        # a source serving a corrupted adapter shard is caught by its signed digest
        bad_store = shutil.copytree(tmp_path / "origin", tmp_path / "bad")
        weights = store.ready_dir(bad_store, 2) / ADAPTER_DIR / ADAPTER_WEIGHTS
        blobs = sorted((weights.parent.parent / "_shardcast").glob("delta-*.bin"))
        for damaged in [weights, *blobs]:  # the adapter's shard and its delta from v1
            data = bytearray(damaged.read_bytes())
            data[-10] ^= 0x01
            damaged.write_bytes(bytes(data))
        liar = serve_store(bad_store, CFG.model_copy(update={"recheck_on_start": False}))
        try:
            alone = WeightClient([liar.url], KEY.public_key_hex, tmp_path / "c2", CFG)
            alone.fetch(1)
            with pytest.raises(CorruptData, match="corrupt"):
                alone.fetch(2)
            assert store.ready_versions(tmp_path / "c2") == [1]
        finally:
            liar.stop()
    finally:
        origin.stop()


def test_proofs_on_base_plus_adapter_pass_and_a_worker_on_the_base_is_rejected(world):
    tokenizer = world["tokenizer"]
    validator_engine = TorchEngine.from_checkpoint(world["path"], dtype="float32")
    worker_engine = TorchEngine.from_checkpoint(world["path"], dtype="float32")
    base_engine = TorchEngine.from_checkpoint(world["versions"].base_dir, dtype="float32")
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    digest = "cd" * 32
    worker = attacks.Worker(worker_engine, KeyPair.from_seed(bytes(32)), params, 1, digest)
    rng = random.Random(0)
    letters = tokenizer.encode("abcdefghijklmnop")
    calib = [[rng.choice(letters) for _ in range(8)] for _ in range(4)]
    measured = measure(
        validator_engine,
        validator_engine.generate(calib, params, range(4), return_hidden=True),
        params,
        ToplocConfig(),
    )
    verifier = Verifier(
        validator_engine,
        ToplocConfig(**recommend(measured, 128)),
        eos_token_ids=validator_engine.eos_ids,
        vocab_size=len(tokenizer),
        scorer=lambda prompt, output: 0.0,
    )
    prompts = [[rng.choice(letters) for _ in range(8)] + tokenizer.encode(":") for _ in range(4)]
    seeds = list(range(50, 54))

    def check(subs):
        items = [
            (b, c, worker.assignment(p, s))
            for (b, c), p, s in zip(subs, prompts, seeds, strict=True)
        ]
        return verifier.check_many(items)

    for verdict in check(attacks.honest(worker, prompts, seeds)):
        assert verdict.accepted, verdict.reasons
    skipped = attacks.with_engine(worker, base_engine, prompts, seeds)  # the adapter skipped
    verdicts = check(skipped)
    assert not any(v.accepted for v in verdicts)
    assert all({"hidden_states", "sampling"} & v.codes for v in verdicts), [
        v.codes for v in verdicts
    ]


def test_adapter_config_is_peft_loadable(world):
    peft = pytest.importorskip("peft")
    config = json.loads((world["path"] / ADAPTER_DIR / "adapter_config.json").read_text())
    assert config["r"] == LORA.rank and config["lora_alpha"] == LORA.alpha
    model = peft.PeftModel.from_pretrained(
        copy.deepcopy(world["base"]), str(world["path"] / ADAPTER_DIR)
    ).eval()
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(_logits(model, ids), _logits(world["wrapped"], ids), atol=1e-5)
