"""A verifiers 0.4 taskset with its harness, and a tiny policy for it, written on the spot (no
downloads): what the tests and the benchmark of ``swarmrl.envs.vf1`` play.

The taskset, ``swarmrl_vf1_sums``: ten sums ``a+(a+1)=``, rewarded when the last reply is the
answer (or, with the taskset's ``dense = true``, by the share of the last reply's characters
that are digits: a signal a random policy meets, for training tests). Its harness is a Python program run by verifiers' subprocess runtime that talks to the
interception like any OpenAI client; its ``mode``: ``check`` asks once more after the first
answer (an environment turn), ``tools`` offers a calculator and runs the calls the model makes,
``crash`` exits 3, ``hang`` never returns; ``lie`` is added to every tool result and is the
number of ``!`` after "sure?" (a tampered harness: the forger of the re-execution tests). The policy: a character tokenizer with the two
tool-call tokens and a chat template that renders user, assistant (with its tool calls) and
tool turns.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.config import EMBEDDED_DEFAULT, load_config
from swarmrl.inference.engine import TorchEngine
from swarmrl.model import build_char_tokenizer, create_tiny_model, save_policy

TASKSET_ID = "swarmrl_vf1_sums"

TASKSET = '''
import sys
import verifiers.v1 as vf

PROGRAM = r"""
import json, sys, time, urllib.request
base, key, model, prompt, mode, lie = sys.argv[1:7]
if mode == "crash":
    print("harness: out of cheese", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    time.sleep(3600)
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "add",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
def ask(messages):
    body = {"model": model, "messages": messages}
    if mode == "tools":
        body["tools"] = TOOLS
    request = urllib.request.Request(
        base.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]["message"]
messages = [{"role": "user", "content": prompt}]
for turn in range(3):
    message = ask(messages)
    calls = message.get("tool_calls") or []
    messages.append({"role": "assistant", "content": message.get("content") or "",
                     **({"tool_calls": calls} if calls else {})})
    for call in calls:
        a, b = json.loads(call["function"]["arguments"])["expression"].split("+")
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": str(int(a) + int(b) + int(lie))})
    if calls:
        continue
    if mode == "check" and turn == 0:
        messages.append({"role": "user", "content": "sure?" + "!" * int(lie)})
        continue
    break
print("answered", len(messages))
"""


class SumData(vf.TaskData):
    answer: str
    dense: bool = False


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        reply = trace.last_reply.strip()
        if task.dense:  # the share of the reply's characters that are digits
            return sum(c.isdigit() for c in reply) / max(len(reply), 1)
        return 1.0 if reply == task.answer else 0.0


class SumTasksetConfig(vf.TasksetConfig):
    dense: bool = False


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self):
        for a in range(10):
            data = SumData(prompt=f"{a}+{a + 1}=", answer=str(2 * a + 1), dense=self.config.dense)
            yield SumTask(data, self.config.task)


class SumHarnessConfig(vf.HarnessConfig):
    mode: str = "check"
    lie: int = 0  # added to every tool result: a harness a forging worker tampered with


class SumHarness(vf.Harness[SumHarnessConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        _, prompt = self.resolve_text_prompt(data)
        argv = [sys.executable, "-c", PROGRAM, endpoint, secret, ctx.model, prompt,
                self.config.mode, str(self.config.lie)]
        return await runtime.run(argv, {})


__all__ = ["SumHarness", "SumTaskset"]
'''

# user/assistant/tool turns, an assistant turn closed by <eos> (the stop token the renderer uses)
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] or '' }}"
    "{% if m['role'] == 'assistant' %}{% for c in m.get('tool_calls') or [] %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": '
    "{% if c.function.arguments is string %}{{ c.function.arguments }}"
    "{% else %}{{ c.function.arguments | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}<eos>{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)
ALPHABET = '0123456789+=<>/?{}[]":,. abcdefghijklmnopqrstuvwxyz_'


def write_taskset(root: Path) -> str:
    """Write the taskset module into ``root``, put ``root`` on ``sys.path``; its id."""
    (root / f"{TASKSET_ID}.py").write_text(textwrap.dedent(TASKSET))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return TASKSET_ID


def char_policy(
    root: Path, hidden: int = 32, layers: int = 1, seed: int = 0
) -> tuple[str, PreTrainedTokenizerBase, PreTrainedModel]:
    """(directory, tokenizer, model): the tokenizer saved in ``root`` (what the renderer
    loads) and a random tiny model over it."""
    tokenizer = build_char_tokenizer(ALPHABET)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root)
    config = load_config(
        [EMBEDDED_DEFAULT],
        [
            f"model.tiny.hidden_size={hidden}",
            f"model.tiny.num_layers={layers}",
            f"model.tiny.intermediate_size={2 * hidden}",
        ],
    )
    torch.manual_seed(seed)
    return str(root), tokenizer, create_tiny_model(config.model.tiny, tokenizer)


def memorizing_engine(tokenizer: PreTrainedTokenizerBase, text: str) -> TorchEngine:
    """An engine whose two-layer model has learnt ``text`` by heart (greedy decoding replays
    it): a policy that makes a given tool call, without a trained model."""
    config = load_config(
        [EMBEDDED_DEFAULT],
        [
            "model.tiny.hidden_size=64",
            "model.tiny.num_layers=2",
            "model.tiny.intermediate_size=128",
        ],
    )
    torch.manual_seed(0)
    model = create_tiny_model(config.model.tiny, tokenizer).train()
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(500):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    return TorchEngine(model.eval(), tokenizer)


def write_run(
    root: Path,
    steps: int = 2,
    prompts: int = 2,
    group: int = 2,
    lr: float = 3e-4,
    eval_every: int = 1,
    eval_samples: int = 1,
    seed: int = 0,
) -> tuple[Path, dict[str, str]]:
    """A run config in ``root`` on the taskset (its dense reward, the ``check`` harness) and a
    random :func:`char_policy` saved as ``model.path``; the environment variables a
    ``swarmrl run`` process needs to import the taskset."""
    (root / "taskset").mkdir(parents=True)
    taskset = write_taskset(root / "taskset")
    _, tokenizer, model = char_policy(root / "tokenizer", seed=seed)
    save_policy(model, tokenizer, root / "policy")
    config = root / "vf1.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [run]
            name = "vf1"
            seed = {seed}
            run_dir = "{root / "runs"}"
            cache_dir = "{root / "cache"}"

            [env]
            name = "verifiers_v1"
            verifiers_env = "{taskset}"
            verifiers_args = {{ dense = true }}
            verifiers_harness_args = {{ mode = "check" }}
            verifiers_timeout_s = 60
            heldout_fraction = 0.2

            [model]
            path = "{root / "policy"}"
            warm_start = false

            [rl]
            steps = {steps}
            prompts_per_step = {prompts}
            group_size = {group}
            lr = {lr}
            online_filter = false

            [rl.sampling]
            max_new_tokens = 6

            [eval]
            n = 2
            every = {eval_every}
            samples = {eval_samples}
            control = false
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "taskset"), *sys.path])}
    return config, env
