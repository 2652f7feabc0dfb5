"""``swarmrl serve``: a trained policy answers the ``openai`` Python client on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from swarmrl.config.model import TinyModelConfig
from swarmrl.errors import MissingPathError, UserError
from swarmrl.model import build_char_tokenizer, create_tiny_model, save_policy
from swarmrl.tools import serve
from swarmrl.tools.checkpoint import find_policy

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

ALPHABET = "0123456789+-*= abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A colocated run directory holding a tiny trained-shape policy in ``policy/``."""
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer(ALPHABET)
    model = create_tiny_model(TinyModelConfig(num_layers=2), tokenizer)
    run = tmp_path_factory.mktemp("runs") / "arith-20260101-000000"
    save_policy(model, tokenizer, run / "policy")
    return run


@pytest.fixture(scope="module")
def server(run_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    port_file = tmp_path_factory.mktemp("serve") / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmrl.cli", "serve", str(run_dir), "--port", "0"]
        + ["--port-file", str(port_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 90
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"swarmrl serve did not start: {proc.communicate()[0]}")
        time.sleep(0.2)
    yield f"http://127.0.0.1:{int(port_file.read_text())}/v1"
    proc.terminate()
    proc.wait(timeout=30)


def _client(url: str):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)


def test_the_openai_client_lists_the_model_and_gets_completions(server: str):
    client = _client(server)
    assert [m.id for m in client.models.list()] == ["arith-20260101-000000"]
    first = client.completions.create(
        model="arith-20260101-000000", prompt="1+2=", max_tokens=5, seed=7, temperature=1.0
    )
    again = client.completions.create(
        model="arith-20260101-000000", prompt="1+2=", max_tokens=5, seed=7, temperature=1.0
    )
    assert first.choices[0].text == again.choices[0].text  # seeded: repeatable
    assert first.usage.prompt_tokens == 5  # <bos> and four characters
    assert 1 <= first.usage.completion_tokens <= 5
    assert first.choices[0].finish_reason in {"stop", "length"}


def test_the_openai_client_chats_with_n_choices(server: str):
    chat = _client(server).chat.completions.create(
        model="arith-20260101-000000",
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


def test_bad_requests_are_400_with_the_openai_error_body(server: str):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as wrong_model:
        client.completions.create(model="other", prompt="1", max_tokens=2)
    assert "not served here" in wrong_model.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="arith-20260101-000000", prompt="1", max_tokens=10**6)
    assert too_long.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="arith-20260101-000000", prompt="1", temperature=-1)
    for prompts in ([], ["1"] * 33):
        with pytest.raises(openai.BadRequestError) as many:
            client.completions.create(model="arith-20260101-000000", prompt=prompts)
        assert many.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as streamed:
        client.chat.completions.create(
            model="arith-20260101-000000", messages=[{"role": "user", "content": "1"}], stream=True
        )
    assert streamed.value.body["param"] == "stream"


def test_find_policy_reads_checkpoints_colocated_and_swarm_runs(run_dir: Path, tmp_path: Path):
    assert find_policy(run_dir) == run_dir / "policy"
    assert find_policy(run_dir / "policy") == run_dir / "policy"
    swarm = tmp_path / "swarm"
    for v in (1, 12):
        version = swarm / "trainer" / "origin" / f"v{v:08d}"
        (version / "_shardcast").mkdir(parents=True)
        (version / "_shardcast" / "manifest.json").write_text("{}")
    (swarm / "trainer" / "origin" / ".partial-v00000013-ab").mkdir()
    assert find_policy(swarm) == swarm / "trainer" / "origin" / "v00000012"
    with pytest.raises(MissingPathError, match="holds no policy"):
        find_policy(tmp_path / "swarm" / "trainer")
    with pytest.raises(MissingPathError, match="no such run directory"):
        find_policy(tmp_path / "nothing")


@pytest.mark.parametrize("extra", [["--port", "0"], ["--port", "8123", "--port-file", "p"]])
def test_vllm_serving_refuses_a_port_it_cannot_report(tmp_path: Path, extra: list[str]):
    """vLLM binds after this process is replaced: an any-port request or a port file would
    be a promise nobody keeps, so both are refused before anything loads."""
    with pytest.raises(UserError, match="fixed --port"):
        serve.main("serve", [str(tmp_path / "absent"), "--engine", "vllm", *extra])
