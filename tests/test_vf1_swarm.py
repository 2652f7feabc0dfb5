"""verifiers 0.4 tasksets on untrusted workers (``env.verifiers_reexecute``): the worker plays
each episode with the taskset's harness and proves every model call; the validator and the
trainer play the harness again with the episode's model turns as the model's answers
(``swarmrl.trainer.harness_check``) and refuse an episode whose environment turns are not the
harness's. Real parts throughout: the tests' taskset and harness program on verifiers'
subprocess runtime, the torch engine behind the token endpoint, the worker's proofs, the
validator's ``judge`` with the verifier's replay, the trainer's ``submission_groups``."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

vf = pytest.importorskip("verifiers", reason="verifiers is not installed")
if Version(vf.__version__) < Version("0.4"):
    pytest.skip(f"verifiers {vf.__version__} is installed, not >=0.4", allow_module_level=True)

from swarmrl.config import EMBEDDED_DEFAULT, load_config  # noqa: E402
from swarmrl.config.env import EnvConfig  # noqa: E402
from swarmrl.envs import build_env  # noqa: E402
from swarmrl.envs.multiturn import require_recomputable  # noqa: E402
from swarmrl.errors import ConfigError, ForgedEpisode  # noqa: E402
from swarmrl.identity import KeyPair  # noqa: E402
from swarmrl.inference.engine import TorchEngine  # noqa: E402
from swarmrl.protocol import SamplingParams  # noqa: E402
from swarmrl.protocol.batches import TrainableSubmission  # noqa: E402
from swarmrl.protocol.episodes import Episode  # noqa: E402
from swarmrl.protocol.pool import Sample, WorkUnit  # noqa: E402
from swarmrl.protocol.verdicts import PendingSubmission  # noqa: E402
from swarmrl.rolekit.policy import LoadedVersion  # noqa: E402
from swarmrl.roles.validator.judge import judge  # noqa: E402
from swarmrl.roles.worker.rollouts import generate_harness_episodes  # noqa: E402
from swarmrl.testing.vf1 import char_policy, memorizing_engine, write_taskset  # noqa: E402
from swarmrl.toploc.bundle import build_bundles  # noqa: E402
from swarmrl.trainer.harness_check import rerun_episodes  # noqa: E402
from swarmrl.trainer.source import submission_groups  # noqa: E402

DIGEST = "ab" * 32
MAX_NEW = 80


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    """(toploc config, taskset id, tokenizer directory, tokenizer, worker key)."""
    taskset = write_taskset(tmp_path_factory.mktemp("taskset"))
    path, tokenizer, _ = char_policy(tmp_path_factory.mktemp("policy"))
    config = load_config([EMBEDDED_DEFAULT], [])
    return config.toploc, taskset, path, tokenizer, KeyPair.generate()


def _env(taskset: str, mode: str, lie: int = 0, reexecute: bool = True, timeout_s: float = 60):
    return build_env(
        EnvConfig(
            name="verifiers_v1",
            verifiers_env=taskset,
            verifiers_harness_args={"mode": mode, "lie": lie},
            verifiers_timeout_s=timeout_s,
            verifiers_reexecute=reexecute,
        )
    )


def _work(worker: KeyPair, task_indices: list[int], group: int, params: SamplingParams):
    return WorkUnit(
        lease_id="l0", pool_id="swarm", node_id=worker.node_id, task_indices=task_indices,
        samples_per_task=group, sampling=params, seed=500, min_version=0, deadline=1e12,
        origin_node_id=worker.node_id, origin_counter=0,
    )  # fmt: skip


def _prover(worker: KeyPair):
    def prove(generations, params):
        bundles = build_bundles(
            generations, keypair=worker, policy_version=0, model_digest=DIGEST, params=params
        )
        return [b.model_dump(mode="json") for b in bundles]

    return prove


def _judge(setup, env, engine: TorchEngine, work: WorkUnit, samples: list[Sample]):
    toploc, _, _, tokenizer, worker = setup
    pending = PendingSubmission(
        submission_id="s0", node_id=worker.node_id, node_key=worker.public_key_hex,
        request_signature="0" * 128, body_digest="0" * 64, request_timestamp_ms=0,
        request_nonce="0" * 32, work=work, samples=samples,
    )  # fmt: skip
    versions = {0: LoadedVersion(0, DIGEST, engine, tokenizer, Path("."))}
    return judge(pending, env, versions.__getitem__, toploc)


def _trained(env, tokenizer, work: WorkUnit, samples: list[Sample], behaviour):
    sub = TrainableSubmission(
        submission_id="s0", node_id="n", task_indices=work.task_indices, samples=samples,
        behaviour_logprobs=behaviour,
    )  # fmt: skip
    return submission_groups(sub, env, tokenizer, work.samples_per_task, MAX_NEW)


@pytest.fixture(scope="module")
def tools(setup):
    """(env, engine, work, train index, honest samples): a policy that has learnt to call the
    calculator on one train task and answer with its result, played by the honest harness."""
    _, taskset, path, tokenizer, worker = setup
    env = _env(taskset, "tools")
    index = 0
    task = env.task("train", index)
    a, b = task.prompt.rstrip("=").split("+")
    call = (
        '<tool_call>{"name": "calc", "arguments": {"expression": "' + f"{a}+{b}" + '"}}'
        "</tool_call><eos>"
    )
    text = f"<u>{task.prompt}<a>{call}<t>{task.answer}<a>{task.answer}<eos>"
    engine = memorizing_engine(tokenizer, text)
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    work = _work(worker, [index], 1, params)
    samples = generate_harness_episodes(engine, env, tokenizer, path, work, 0, _prover(worker))
    return env, engine, work, task, samples


def test_a_worker_submits_harness_episodes_with_one_proof_per_model_call(setup, tools):
    _, _, _, tokenizer, _ = setup
    _, _, _, task, [sample] = tools
    episode = sample.episode
    assert episode is not None and episode.reward is None  # the trusted side scores
    roles = [t.role for _, t in episode.turns()]
    assert roles == ["context", "model", "env", "model"]
    [segment] = episode.segments
    tool_turn = segment.span(segment.turns[2])
    assert tokenizer.decode(tool_turn) == f"<t>{task.answer}<a>"  # the calculator's result
    assert sample.turn_proofs is not None and len(sample.turn_proofs) == 2
    assert all(isinstance(p, dict) for p in sample.turn_proofs)


def test_an_honest_harness_episode_is_accepted_with_the_replayed_reward(setup, tools):
    _, _, _, tokenizer, _ = setup
    env, engine, work, _, samples = tools
    judgement = _judge(setup, env, engine, work, samples)
    assert judgement.verdict is not None and judgement.verdict.accept, judgement.verdict
    # the reward is the taskset's on the trace the trusted side played itself
    assert judgement.rewards == [1.0]
    [groups] = _trained(env, tokenizer, work, samples, judgement.verdict.behaviour_logprobs)
    assert [c.reward for c in groups.completions] == [1.0]


def test_a_tampered_harness_is_caught_where_its_tool_result_differs(setup, tools):
    """A forging worker runs a harness whose calculator adds one; the model reads the forged
    result and goes on from it, every call proven: only the replay of the harness shows it."""
    _, taskset, path, tokenizer, worker = setup
    env, engine, work, task, _ = tools
    forger = _env(taskset, "tools", lie=1)
    samples = generate_harness_episodes(engine, forger, tokenizer, path, work, 0, _prover(worker))
    [segment] = samples[0].episode.segments
    assert tokenizer.decode(segment.span(segment.turns[2])) == f"<t>{int(task.answer) + 1}<a>"
    judgement = _judge(setup, env, engine, work, samples)
    assert judgement.verdict is not None and not judgement.verdict.accept
    assert judgement.verdict.severity == "hard"
    assert "env_mismatch: call 1's prompt differs" in judgement.verdict.reasons[0]
    # released unchecked, it would not train either: the trainer replays the harness too
    behaviour = [samples[0].logprobs]
    with pytest.raises(ForgedEpisode, match="env_mismatch"):
        _trained(env, tokenizer, work, samples, behaviour)


def _cut(episode: Episode, keep_turns: int) -> Episode:
    [segment] = episode.segments
    turns = segment.turns[:keep_turns]
    model = sum(t.end - t.start for t in turns if t.role == "model")
    cut = segment.model_copy(
        update={
            "tokens": segment.tokens[: turns[-1].end],
            "turns": turns,
            "logprobs": segment.logprobs[:model],
        }
    )
    return episode.model_copy(update={"segments": [cut]})


def test_an_episode_that_stops_before_the_harness_does_is_refused(setup, tools):
    _, _, _, tokenizer, _ = setup
    env, engine, work, task, [sample] = tools
    short = _cut(sample.episode, 2)  # the tool call alone, as if the harness had ended there
    [rerun] = rerun_episodes(env, tokenizer, [task], [short], work.sampling)
    assert rerun.rejection.startswith("call_count: the harness asked for call 1")


def test_a_replay_past_its_timeout_drops_the_unit_without_a_ban(setup, tools):
    """The trusted side's harness hangs (here: the harness is the hanging one): no proof
    against the worker, and the unit is not judged again at every claim."""
    _, taskset, _, _, _ = setup
    _, engine, work, _, samples = tools
    hanging = _env(taskset, "hang", timeout_s=2)
    judgement = _judge(setup, hanging, engine, work, samples)
    assert judgement.verdict is not None and not judgement.verdict.accept
    assert judgement.verdict.severity == "soft"
    assert "ran past its 2 s timeout" in judgement.verdict.reasons[0]


def test_honest_sampled_episodes_replay_exactly_batched(setup):
    """Several episodes of a sampling policy (the ``check`` harness asks "sure?" after the
    first answer), replayed at once: every one equal, rewards the taskset's."""
    _, taskset, path, tokenizer, worker = setup
    env = _env(taskset, "check")
    _, _, model = char_policy(Path(path), seed=3)
    engine = TorchEngine(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    work = _work(worker, [0, 1, 2], 2, params)
    samples = generate_harness_episodes(engine, env, tokenizer, path, work, 0, _prover(worker))
    assert all(s.episode.model_turns() == 2 for s in samples)
    tasks = [env.task("train", t) for t in work.task_indices for _ in range(2)]
    reruns = rerun_episodes(env, tokenizer, tasks, [s.episode for s in samples], params)
    assert [r.rejection for r in reruns] == [""] * 6
    assert [r.calls for r in reruns] == [s.episode.calls() for s in samples]
    assert all([p.max_new_tokens for p in r.sampling] == [6, 6] for r in reruns)
    judgement = _judge(setup, env, engine, work, samples)
    assert judgement.verdict is not None and judgement.verdict.accept, judgement.verdict
    assert judgement.rewards == [r.reward for r in reruns]


def test_untrusted_workers_need_the_reexecute_setting(setup):
    _, taskset, _, _, _ = setup
    with pytest.raises(ConfigError) as refused:
        require_recomputable(_env(taskset, "check", reexecute=False))
    assert "\n" not in str(refused.value) and "verifiers_reexecute" in str(refused.value)
    require_recomputable(_env(taskset, "check"))  # declared deterministic: allowed
    # a harness that runs model-written code is never replayed on the trusted side
    config = EnvConfig(
        name="verifiers_v1", verifiers_env=taskset, verifiers_harness="bash",
        verifiers_reexecute=True,
    )  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        build_env(config)
    assert "\n" not in str(refused.value) and "runs model-written code" in str(refused.value)
