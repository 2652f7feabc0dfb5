"""Config of the verifiable environment (task) the policy is trained on."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from swarmrl.config.base import Section, path_key


class LengthBudgetConfig(Section):
    """Thinking-budget wrapper: r = r_task − alpha·|target − length| (mode-dependent)."""

    enabled: bool = Field(False, description="wrap the task with a per-prompt target length")
    targets: list[int] = Field(
        default_factory=lambda: [8, 16], description="target lengths, tokens"
    )
    alpha: float = Field(3e-4, ge=0, description="penalty per token of deviation")
    mode: Literal["exact", "max", "clip"] = Field(
        "exact",
        description="exact: r−α|t−l|; max: only overshoot costs; clip: r·(1−α|t−l|), never < 0",
    )


class ReasoningGymTask(Section):
    """One ``reasoning_gym`` generator and its share of the problems."""

    name: str = Field(description="reasoning_gym dataset name, e.g. 'leg_counting'")
    weight: float = Field(1.0, gt=0, description="relative share of the problems")
    config: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the generator's config"
    )


class SandboxConfig(Section):
    """Where and how completions' code runs (trusted side only: validator and trainer)."""

    mode: Literal["auto", "bwrap", "unshare", "rlimit"] = Field(
        "auto",
        description="bwrap: bubblewrap's namespaces + rlimits; unshare: the kernel's namespaces "
        "made directly (no bubblewrap) + rlimits; auto: bwrap, else unshare, else refuse to "
        "start; rlimit: rlimits only, no isolation (only when named; warns)",
    )
    cpu_s: int = Field(2, ge=1, description="CPU-time limit per run, seconds")
    wall_s: float = Field(5.0, gt=0, description="wall-clock limit per run, seconds")
    memory_mb: int = Field(512, ge=32, description="address-space limit per process, MiB")
    processes: int = Field(16, ge=1, description="processes/threads the program may add")
    output_bytes: int = Field(65536, ge=1, description="stdout+stderr kept; more is a failure")
    file_mb: int = Field(16, ge=1, description="largest file the program may write, MiB")
    python: str | None = Field(
        None,
        description="interpreter that runs the code (default: /usr/bin/python3 when present, "
        "else the one running swarmrl)",
        json_schema_extra=path_key("path or command"),
    )


class EnvConfig(Section):
    """Which task, and how its problems are drawn."""

    name: Literal[
        "arith",
        "reverse",
        "math",
        "reasoning_gym",
        "verifiers",
        "verifiers_v1",
        "code",
        "code_tiny",
        "tool_arith",
        "guess",
    ] = Field("arith", description="built-in task (tool_arith, guess: multi-turn episodes)")
    digits: int = Field(3, ge=1, le=9, description="arith, tool_arith: digits per operand")
    guess_n: int = Field(
        32, ge=2, le=10**6, description="guess: the hidden number is in 1..guess_n"
    )
    guess_ranges: bool = Field(
        False,
        description="guess: each problem starts from its own range of at least two numbers "
        "in 1..guess_n (held out: (range, number) pairs never trained; guess_n <= 1024); "
        "false: every problem starts from 1..guess_n",
    )
    max_turns: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="multi-turn tasks: model turns per episode (None: the "
        "task's default, tool_arith 3, guess 6)",
    )
    token_budget: int | None = Field(
        None,
        ge=1,
        le=10**6,
        description="multi-turn tasks: model + environment tokens per "
        "episode after the prompt (None: the task's default, tool_arith 64, guess 96)",
    )
    reverse_len: int = Field(6, ge=1, description="reverse: characters per string")
    dataset: str | None = Field(
        None,
        description="math/code: a local directory, a .jsonl/.json/.parquet file, or a Hugging "
        "Face hub id (needs network)",
        json_schema_extra=path_key("path or hub id"),
    )
    dataset_split: str = Field("train", description="math/code: split of the dataset to read")
    dataset_config: str | None = Field(None, description="math/code: hub dataset config name")
    problem_column: str = Field("problem", description="math/code: column holding the problem")
    answer_column: str = Field("answer", description="math: column holding the reference answer")
    solution_column: str | None = Field(
        None,
        description="math: column holding a worked solution ending in \\boxed{answer}, the "
        "warm-start demonstration (None = the boxed answer alone)",
    )
    answer_format: Literal["auto", "plain", "gsm8k", "boxed"] = Field(
        "auto",
        description="math: how the reference answer is written: gsm8k = after '####', boxed = "
        "last \\boxed{}, plain = as is, auto = whichever of these matches",
    )
    tests_column: str = Field(
        "tests",
        description="code: column holding the tests ({'inputs','outputs'} stdin/stdout cases, "
        "or assert statements)",
    )
    tasks: list[ReasoningGymTask] = Field(
        default_factory=list, description="reasoning_gym: generators and their weights"
    )
    size: int = Field(10000, ge=2, description="reasoning_gym: problems generated")
    seed: int = Field(0, description="reasoning_gym: generator seed")
    partial_credit: bool = Field(
        True,
        description="reasoning_gym: the reward is the library's score, partial credit included "
        "(false: 1 for a fully correct answer, else 0; some generators score a wrong answer "
        "that contains the right one above 0, which RL on a small model learns to exploit)",
    )
    verifiers_env: str | None = Field(
        None,
        description="verifiers: environment id given to verifiers.load_environment; "
        "verifiers_v1: the taskset id (a module exporting its Taskset in __all__)",
    )
    verifiers_args: dict[str, Any] = Field(
        default_factory=dict,
        description="verifiers: keyword arguments of load_environment; verifiers_v1: the "
        "taskset config's fields",
    )
    verifiers_harness: str | None = Field(
        None,
        description="verifiers_v1: harness id (None: the taskset's own harness, else "
        "verifiers' bash); runs on the subprocess runtime",
    )
    verifiers_harness_args: dict[str, Any] = Field(
        default_factory=dict, description="verifiers_v1: the harness config's fields"
    )
    verifiers_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description="verifiers_v1: seconds each stage of an episode may take (setup, the "
        "harness's run, scoring); past it the harness is killed and the episode fails",
    )
    verifiers_reexecute: bool = Field(
        False,
        description="verifiers_v1: let untrusted workers play the taskset; the validators and "
        "the trainer run the harness again with each episode's model turns and refuse an "
        "episode whose environment turns differ. Set it only for a harness whose tool results "
        "and messages are a function of the task and the model's turns (no clock, randomness "
        "or outside world): otherwise honest workers are rejected",
    )
    system_prompt: str | None = Field(
        None, description="system prompt a tokenizer's chat template puts before each prompt"
    )
    train_subset: str | None = Field(
        None,
        description="JSONL written by `swarmrl filter`: train only on its problem ids "
        "(held-out split unchanged)",
        json_schema_extra=path_key(),
    )
    heldout_fraction: float = Field(
        0.1, gt=0, lt=1, description="share of the problem space reserved for held-out eval"
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    length_budget: LengthBudgetConfig = Field(default_factory=LengthBudgetConfig)
