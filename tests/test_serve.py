"""``swarmrl serve RUN_DIR`` on the directory a real ``swarmrl run`` wrote: the ``openai``
Python client lists the model, gets completions and chats, whole and streamed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmrl.config.serve import ServeLimits
from swarmrl.errors import MissingPathError, UserError
from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher
from swarmrl.testing.serve import ServeProcess
from swarmrl.tools import serve
from swarmrl.tools.checkpoint import find_policy

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def server(colocated_run: Path) -> Iterator[ServeProcess]:
    with ServeProcess(colocated_run, "--api-key", KEY, "--threads", "1") as proc:
        yield proc


def _client(proc: ServeProcess, key: str = KEY):
    return openai.OpenAI(base_url=f"{proc.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_serve_takes_the_run_directory_and_serves_its_policy(
    server: ServeProcess, colocated_run: Path
):
    client = _client(server)
    assert [m.id for m in client.models.list()] == [colocated_run.name]
    first = client.completions.create(
        model=colocated_run.name, prompt="1+2=", max_tokens=5, seed=7, temperature=1.0
    )
    again = client.completions.create(
        model=colocated_run.name, prompt="1+2=", max_tokens=5, seed=7, temperature=1.0
    )
    assert first.choices[0].text == again.choices[0].text  # seeded: repeatable
    assert first.usage.prompt_tokens == 5  # <bos> and four characters
    assert 1 <= first.usage.completion_tokens <= 5
    assert first.choices[0].finish_reason in {"stop", "length"}
    assert f"from {colocated_run / 'policy'} at" in server.log.read_text()


def test_the_openai_client_chats_with_n_choices(server: ServeProcess, colocated_run: Path):
    chat = _client(server).chat.completions.create(
        model=colocated_run.name,
        messages=[{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="}],
        max_completion_tokens=4,
        n=3,
        seed=1,
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in chat.choices)
    assert all(isinstance(c.message.content, str) for c in chat.choices)
    # <bos>, the system text, a blank line, the user text: one token a character, per choice
    assert chat.usage.prompt_tokens == 3 * (1 + len("add\n\n3+4="))


def test_a_streamed_chat_says_what_the_whole_answer_says(server: ServeProcess, colocated_run: Path):
    client = _client(server)
    ask = {
        "model": colocated_run.name,
        "messages": [{"role": "user", "content": "12+34="}],
        "max_tokens": 40,
        "n": 2,
        "seed": 3,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**ask)
    texts, reasons, roles, usage = ["", ""], [None, None], set(), None
    for chunk in client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}
    ):
        assert chunk.object == "chat.completion.chunk" and chunk.model == colocated_run.name
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles.add(choice.delta.role)
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert all(len(t) > 0 for t in texts)
    assert reasons == ["length", "length"]  # ignore_eos: every choice runs to max_tokens
    assert "assistant" in roles
    assert usage is not None and usage.completion_tokens == 80 == whole.usage.completion_tokens


def test_a_streamed_completion_stops_at_a_stop_string(server: ServeProcess, colocated_run: Path):
    client = _client(server)
    ask = {"model": colocated_run.name, "prompt": "1+2=", "max_tokens": 60, "seed": 5}
    full = client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[10:12]  # two characters the answer holds
    cut = full[: full.find(stop)]
    streamed = client.completions.create(
        **ask, stop=[stop], stream=True, extra_body={"ignore_eos": True}
    )
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == cut
    assert pieces[-1].choices[0].finish_reason == "stop"
    whole = client.completions.create(**ask, stop=[stop], extra_body={"ignore_eos": True})
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"


def test_find_policy_reads_the_run_directories_swarmrl_run_writes(
    colocated_run: Path, tmp_path: Path
):
    assert find_policy(colocated_run) == colocated_run / "policy"
    assert find_policy(colocated_run / "policy") == colocated_run / "policy"
    # a swarm run before its end: no policy/ yet, versions the trainer's origin published
    running = tmp_path / "running"
    shutil.copytree(colocated_run, running, ignore=shutil.ignore_patterns("policy"))
    publisher = Publisher(running / "trainer" / "origin", KeyPair.generate())
    for version in (0, 1):
        publisher.publish(colocated_run / "policy", version)
    assert find_policy(running) == running / "trainer" / "origin" / "v00000001"
    shutil.rmtree(running / "trainer")
    with pytest.raises(MissingPathError, match="holds no policy: looked for an HF checkpoint"):
        find_policy(running)  # config.json (the run's) alone is no checkpoint
    with pytest.raises(MissingPathError, match="no such run directory"):
        find_policy(tmp_path / "nothing")


def test_serve_names_what_it_looked_for_in_one_line(colocated_run: Path, tmp_path: Path):
    empty = tmp_path / "empty-run"
    empty.mkdir()
    shutil.copy(colocated_run / "config.json", empty / "config.json")
    done = subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "serve", str(empty), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "holds no policy: looked for an HF checkpoint" in done.stderr
    assert json.loads((empty / "config.json").read_text())["env"]["name"] == "arith"


@pytest.mark.parametrize("extra", [["--port", "0"], ["--port", "8123", "--port-file", "p"]])
def test_vllm_serving_refuses_a_port_it_cannot_report(tmp_path: Path, extra: list[str]):
    """vLLM binds after this process is replaced: an any-port request or a port file would
    be a promise nobody keeps, so both are refused before anything loads."""
    with pytest.raises(UserError, match="fixed --port"):
        serve.main("serve", [str(tmp_path / "absent"), "--engine", "vllm", *extra])


def test_a_limit_flag_out_of_range_is_one_line_naming_it(tmp_path: Path):
    with pytest.raises(UserError, match=r"max_tokens \(50\) is over max_tokens_limit \(10\)"):
        serve.main("serve", [str(tmp_path), "--max-tokens", "50", "--max-tokens-limit", "10"])
    with pytest.raises(UserError, match="--max-concurrent: "):
        serve.main("serve", [str(tmp_path), "--max-concurrent", "0"])


def test_docs_serve_lists_every_limit_with_its_default():
    page = (Path(__file__).resolve().parents[1] / "docs" / "serve.md").read_text()
    for name, spec in ServeLimits.model_fields.items():
        assert f"| `--{name.replace('_', '-')}` | {spec.default} |" in page, name
