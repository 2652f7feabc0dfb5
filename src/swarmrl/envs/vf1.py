"""``verifiers_v1``: a taskset of verifiers 0.4 (``verifiers.v1``) played by its harness; each
rollout becomes a swarmrl :class:`~swarmrl.protocol.episodes.Episode`, scored by the taskset's
own reward functions.

How an episode is played (:meth:`VerifiersV1Env.run_episodes`)::

    harness program ──OpenAI chat──▶ verifiers interception (records the trace)
      (subprocess runtime)              │ train client: renders the conversation with the
                                        ▼ tokenizer's chat template (``renderers``)
                                    token endpoint (a :class:`TokenSource`: swarmrl's engine,
                                    ``swarmrl.inference.token_endpoint``; call k of the episode
                                    samples with ``derive_seed("turn", seed, k)``)

The trace's message graph holds, for every model call, the tokens of its prompt and the tokens
it sampled with their log-probs; :func:`trace_calls` reads them back as
:class:`~swarmrl.protocol.episodes.ModelCall` and ``episode_from_calls`` makes the episode (a new
segment where a later prompt does not extend the earlier tokens). The endpoint's own record of
what it sampled must equal the trace's, call by call, or the episode is refused.

Config (``[env]``): ``name = "verifiers_v1"``; ``verifiers_env`` the taskset id (an importable
package or module exporting its ``Taskset`` subclass in ``__all__``); ``verifiers_args`` the
taskset config's fields; ``verifiers_harness`` the harness id (None: the taskset's own harness
when its module exports one, else verifiers' default ``bash``) and ``verifiers_harness_args``
its config fields; ``verifiers_timeout_s`` bounds each stage of an episode (setup, the
harness's run, scoring). Only the ``subprocess`` runtime is used: no container engine, no
network. A harness that needs a container (``Harness.NEEDS_CONTAINER``) is refused at start.
The taskset must be finite (its tasks are the problem space, split by swarmrl).

Failures are :class:`~swarmrl.errors.HarnessFailed`, one line naming the task: a harness program
that exits non-zero (the tail of its stderr), one that runs past ``verifiers_timeout_s`` (it is
killed), an episode with no model call, a trace that differs from the engine's record.

Rewards: the weighted sum of the taskset's ``@vf.reward`` functions, clipped to [0, 1]
(``raw_reward`` keeps the sum); ``correct`` means 1. :meth:`VerifiersV1Env.score_episode` is
the trusted side's: it checks that the trace carries exactly the episode's tokens and runs the
taskset's rewards on it again, without the harness's runtime (a taskset whose rewards need the
runtime cannot be scored there: :attr:`VerifiersV1Env.trusted_scoring` is False).

Untrusted workers: the environment turns (tool results, a simulated user) are what the harness
program wrote on the worker. A pool with untrusted workers refuses these tasks
(:attr:`VerifiersV1Env.untrusted_refusal`, one line) unless ``env.verifiers_reexecute`` says the
harness is deterministic given the model's turns: then the trusted side plays each episode
again with the claimed model turns as the model's answers (``swarmrl.trainer.harness_check``)
and refuses one whose environment turns differ (docs/tasks.md). A harness that runs
model-written code (verifiers' ``Harness.EXECUTES_CODE``: ``bash`` and every agent harness) is
never replayed: that would run a worker's code on the trusted side.

Knows nothing about models or weights: tokens come from a :class:`TokenSource`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Protocol

from packaging.version import Version

from swarmrl.envs.base import Environment, Score, Split, Task
from swarmrl.envs.data import require
from swarmrl.errors import ConfigError, HarnessFailed, HarnessTimedOut, Invalid
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.episodes import Episode, ModelCall, episode_from_calls

UNTRUSTED_REFUSAL = (
    "env.name = 'verifiers_v1': its environment turns are written by a harness program on the "
    "worker; run it with --colocated, or set env.verifiers_reexecute = true where the harness's "
    "turns are a function of the task and the model's turns (the trusted side replays them)"
)


# the built-in harnesses whose chat program verifiers prepares as a uv script
UV_HARNESSES = ("null", "bash")


class TokenSource(Protocol):
    """Where a harness's model calls are answered (``swarmrl.inference.token_endpoint``)."""

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/v1`` of vLLM's token wire (``/inference/v1/generate``)."""
        ...

    def calls(self, session: str) -> list[ModelCall]:
        """What was sampled for ``session`` (verifiers' trace id), in order."""
        ...


@dataclass(frozen=True)
class HarnessEpisode:
    """One played episode: the swarmrl episode (reward set), the verifiers trace it came from
    (a ``verifiers.v1.Trace``) and the taskset's reward before clipping."""

    episode: Episode
    trace: Any
    raw_reward: float


def require_v1() -> ModuleType:
    """``verifiers.v1``, or a one-line :class:`ConfigError` naming the version to install."""
    vf = require("verifiers", "env.name = 'verifiers_v1'")
    version = str(getattr(vf, "__version__", "0"))
    # 0.3 ships an earlier preview of `verifiers.v1` with other interfaces
    if not Version("0.4") <= Version(version) < Version("0.5"):
        raise ConfigError(
            f"env.name = 'verifiers_v1' needs verifiers>=0.4,<0.5 (installed: {version}); "
            'pip install "verifiers>=0.4,<0.5"'
        )
    import verifiers.v1 as v1

    return v1


def trace_calls(trace: Any) -> list[ModelCall]:
    """The model calls of a ``verifiers.v1.Trace``, in the order they were made: each call's
    prompt is its path's tokens up to its assistant node plus that node's unsampled prefix (the
    generation prompt), its output the node's sampled tokens (``MessageNode.mask``)."""
    calls = []
    for k, call in enumerate(trace.calls):
        if call.node is None or call.error is not None:
            raise HarnessFailed(f"model call {k} of trace {trace.id} did not complete")
        if not 0 <= call.node < len(trace.nodes):
            raise HarnessFailed(f"model call {k} of trace {trace.id} names no node")
        node = trace.nodes[call.node]
        sampled = sum(node.mask)
        head = len(node.mask) - sampled
        if any(node.mask[:head]) or len(node.logprobs) != sampled or not sampled:
            raise HarnessFailed(f"model call {k} of trace {trace.id} has no sampled tokens")
        prefix: list[int] = []
        parent = node.parent
        path = []
        while parent is not None:
            if len(path) >= len(trace.nodes) or not 0 <= parent < len(trace.nodes):
                raise HarnessFailed(f"model call {k} of trace {trace.id} has a broken path")
            path.append(parent)
            parent = trace.nodes[parent].parent
        for nid in reversed(path):
            prefix += trace.nodes[nid].token_ids
        prompt = prefix + list(node.token_ids[:head])
        calls.append(ModelCall(prompt, list(node.token_ids[head:]), list(node.logprobs)))
    return calls


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _shared_loop() -> asyncio.AbstractEventLoop:
    """The event loop every verifiers episode of this process runs on, a thread that lives as
    long as the process. verifiers and renderers keep process-wide asyncio locks (a renderer's,
    per tokenizer) that bind to the loop that first waits on one, so every environment of the
    process (a worker's honest and forging ones, a validator's replays) must share one loop:
    with one loop per environment, a second environment failed its model calls whenever the
    lock was contended ("bound to a different event loop")."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(
                target=_LOOP.run_forever, name="verifiers-v1-loop", daemon=True
            ).start()
        return _LOOP


def _uv_found() -> bool:
    """Whether the subprocess runtime finds ``uv`` (it also looks in ``~/.local/bin``);
    without it verifiers would ``pip install --user uv`` on its own."""
    path = os.pathsep.join([os.environ.get("PATH", ""), os.path.expanduser("~/.local/bin")])
    return shutil.which("uv", path=path) is not None


def _clip(raw: float) -> float:
    return min(1.0, max(0.0, raw)) if math.isfinite(raw) else 0.0


def _needs_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


class VerifiersV1Env(Environment):
    """The tasks of a verifiers v1 taskset; episodes played by its harness (module docstring)."""

    name = "verifiers_v1"
    alphabet = None
    prose = True

    def __init__(
        self,
        taskset_id: str,
        taskset_args: dict[str, Any] | None = None,
        harness_id: str | None = None,
        harness_args: dict[str, Any] | None = None,
        heldout_fraction: float = 0.1,
        timeout_s: float = 120.0,
        reexecute: bool = False,
    ) -> None:
        super().__init__(heldout_fraction)
        vf = require_v1()
        self.vf, self.timeout_s = vf, timeout_s
        # why untrusted workers may not play these tasks (None: the trusted side replays them)
        self.untrusted_refusal = None if reexecute else UNTRUSTED_REFUSAL
        stages = {"setup": timeout_s, "rollout": timeout_s, "scoring": timeout_s}
        agent: dict[str, Any] = {"runtime": {"type": "subprocess"}, "timeout": stages}
        try:
            if harness_id or harness_args:
                chosen = harness_id or vf.default_harness_id(taskset_id)
                agent["harness"] = {"id": chosen, **(harness_args or {})}
            config = vf.SingleAgentEnvConfig(
                taskset={"id": taskset_id, **(taskset_args or {})},
                agent=agent,
                timeout={"episode": 4 * timeout_s},
            )
            harness = vf.load_harness(config.agent_harnesses()["agent"])
            if reexecute and harness.EXECUTES_CODE:
                raise ConfigError(
                    f"env.verifiers_reexecute: harness {harness.config.id!r} runs model-written "
                    "code on its host; replaying workers' episodes would run it on the trusted "
                    "side, unisolated (only harnesses without code execution are replayed)"
                )
            if harness.config.id in UV_HARNESSES and not _uv_found():
                raise ConfigError(
                    f"verifiers harness {harness.config.id!r} builds its program with uv (from "
                    "the package index, at its first episode on a machine): pip install uv"
                )
            if harness.NEEDS_CONTAINER:
                raise ConfigError(
                    f"verifiers harness {harness.config.id!r} needs a container runtime; "
                    "only the subprocess runtime is supported (harnesses null, bash, or the "
                    "taskset's own)"
                )
            self.vf_env = vf.load_environment(config)
            if not self.vf_env.taskset.bounded:
                raise ConfigError(f"verifiers taskset {taskset_id!r} is infinite")
            self.vf_tasks = list(self.vf_env.taskset)
        except (ImportError, ValueError, TypeError, AttributeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"env.verifiers_env {taskset_id!r}: {first}") from exc
        if len(self.vf_tasks) < 2:
            raise ConfigError(f"verifiers taskset {taskset_id!r}: needs at least 2 tasks")
        self.harness_id = harness.config.id
        rewards = self.vf_tasks[0].hooks("reward")
        self.trusted_scoring = not any(_needs_runtime(fn) for fn in rewards)

    def _run(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on the process's one verifiers loop (:func:`_shared_loop`)."""
        return asyncio.run_coroutine_threadsafe(coroutine, _shared_loop()).result()

    # --- the problem space --------------------------------------------------------------------
    def space_size(self) -> int:
        return len(self.vf_tasks)

    def problem(self, problem_id: int) -> tuple[str, str]:
        data = self.vf_tasks[problem_id].data
        return data.prompt_text, str(getattr(data, "answer", "") or "")

    def record(self, problem_id: int) -> dict[str, Any]:
        return self.vf_tasks[problem_id].data.model_dump(mode="json", exclude_none=True)

    def task(self, split: Split, index: int) -> Task:
        base = super().task(split, index)
        # ``env.system_prompt`` where set, else the task's own
        system = self.system_prompt or self.vf_tasks[base.problem_id].data.system_prompt
        return replace(base, system=system)

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        raise ConfigError(
            "env.name = 'verifiers_v1' scores whole harness episodes (score_episode); "
            "a single completion has no trace to score"
        )

    # --- episodes -----------------------------------------------------------------------------
    def run_episodes(
        self,
        tasks: Sequence[Task],
        seeds: Sequence[int],
        source: TokenSource,
        tokenizer_path: str,
        params: SamplingParams,
        model: str = "policy",
    ) -> list[HarnessEpisode]:
        """Play one episode per task, concurrently (the source answers the calls); episode i
        samples from ``seeds[i]``. ``tokenizer_path`` is the policy's directory: its tokenizer
        and chat template render every prompt. The first episode that fails raises its
        :class:`HarnessFailed`."""
        played = self.play_each(tasks, seeds, source, tokenizer_path, params, model)
        for outcome in played:
            if isinstance(outcome, HarnessFailed):
                raise outcome
        return played  # type: ignore[return-value]

    def play_each(
        self,
        tasks: Sequence[Task],
        seeds: Sequence[int],
        source: TokenSource,
        tokenizer_path: str,
        params: SamplingParams,
        model: str = "policy",
    ) -> list[HarnessEpisode | HarnessFailed]:
        """:meth:`run_episodes`, each episode's failure returned in its place instead."""
        if len(tasks) != len(seeds):
            raise ValueError(f"{len(tasks)} tasks but {len(seeds)} seeds")
        return self._run(self._run_all(tasks, seeds, source, tokenizer_path, params, model))

    async def _run_all(
        self,
        tasks: Sequence[Task],
        seeds: Sequence[int],
        source: TokenSource,
        tokenizer_path: str,
        params: SamplingParams,
        model: str,
    ) -> list[HarnessEpisode | HarnessFailed]:
        from renderers.configs import DefaultRendererConfig

        vf = self.vf
        client = vf.TrainClientConfig(
            base_url=source.base_url,
            api_key_var="SWARMRL_TOKEN_ENDPOINT_KEY",  # loopback: no key
            renderer=DefaultRendererConfig(tool_parser="qwen3"),
            renderer_model_name=tokenizer_path,
        )

        async def one(task: Task, seed: int) -> HarnessEpisode | HarnessFailed:
            sampling = {
                "temperature": params.temperature,
                "top_p": params.top_p,
                "max_tokens": params.max_new_tokens,
                "seed": seed,
            }
            if params.top_k:
                sampling["top_k"] = params.top_k
            ctx = vf.ModelContext(model=model, client=client, sampling=vf.Sampling(**sampling))
            played = await self.vf_env.run_episode(self.vf_tasks[task.problem_id], ctx)
            try:
                return self._episode(task, seed, played, source)
            except HarnessFailed as exc:
                return exc

        async with self.vf_env.serving():
            return list(
                await asyncio.gather(*(one(t, s) for t, s in zip(tasks, seeds, strict=True)))
            )

    def _episode(self, task: Task, seed: int, played: Any, source: TokenSource) -> HarnessEpisode:
        where = f"verifiers task {task.problem_id} ({self.harness_id} harness)"
        trace = played.traces[0] if played.traces else None
        errors = [*played.errors, *(trace.errors if trace is not None else [])]
        if played.is_timeout or (trace is not None and trace.is_timeout):
            raise HarnessTimedOut(f"{where}: ran past its {self.timeout_s:g} s timeout")
        if trace is None or not played.ok or not trace.ok:
            last = errors[-1] if errors else None
            detail = (last.message.strip().splitlines() or [""])[-1] if last else "no trace"
            kind = last.type if last else "error"
            raise HarnessFailed(f"{where} failed: {kind}: {detail}")
        if not trace.calls:
            raise HarnessFailed(f"{where}: the harness made no model call")
        calls = trace_calls(trace)
        sampled = source.calls(trace.id)
        if calls != sampled:
            same = [a == b for a, b in zip(calls, sampled, strict=False)]
            k = same.index(False) if False in same else len(same)
            raise HarnessFailed(f"{where}: the trace differs from the sampled tokens at call {k}")
        raw = float(trace.reward)
        return HarnessEpisode(episode_from_calls(calls, seed, _clip(raw)), trace, raw)

    # --- the trusted side ---------------------------------------------------------------------
    def score_episode(self, task: Task, episode: Episode, trace: Any) -> Score:
        """The taskset's reward of ``trace`` (a ``verifiers.v1.Trace``, or its JSON record,
        ``Trace.to_record(float_decimals=None)``), recomputed here for this side's own copy of
        the task, after checking that the trace carries exactly ``episode``'s tokens and turns
        (else :class:`~swarmrl.errors.Invalid`; the log-probs are the proofs' to check)."""
        if not self.trusted_scoring:
            raise ConfigError(
                f"verifiers task {task.problem_id}: its rewards read the harness's runtime, "
                "which the trusted side does not have"
            )
        where = f"verifiers task {task.problem_id}"
        try:
            if isinstance(trace, dict):
                trace = self.vf.WireTrace.model_validate(trace)
            rebuilt = episode_from_calls(trace_calls(trace), episode.seed)
        except (ValueError, HarnessFailed) as exc:  # pydantic's ValidationError included
            first = (str(exc).strip().splitlines() or ["unreadable"])[0]
            raise Invalid(f"{where}: the trace is unreadable: {first}") from exc
        if [(s.tokens, s.turns) for s in rebuilt.segments] != [
            (s.tokens, s.turns) for s in episode.segments
        ]:
            raise Invalid(f"{where}: the trace is not this episode")
        scored = trace.model_copy(update={"rewards": {}, "metrics": {}})
        self._run(self.vf_tasks[task.problem_id].score(scored))
        raw = float(scored.reward)
        return Score(_clip(raw), {"correct": _clip(raw) == 1.0, "raw_reward": raw})
