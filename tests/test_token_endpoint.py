"""The token endpoint (``swarmrl.inference.token_endpoint``) on loopback over a real tiny engine:
seeded per episode and call, and bad requests refused with a clear answer while it goes on
serving."""

from __future__ import annotations

import httpx
import pytest

from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.token_endpoint import GENERATE_PATH, SESSION_HEADER, serve_engine
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.seeds import derive_seed

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=5)


@pytest.fixture(scope="module")
def engine(tiny_arith) -> TorchEngine:
    _, _, tokenizer, model = tiny_arith
    return TorchEngine(model, tokenizer)


def _body(prompt: list[int], **sampling) -> dict:
    return {"model": "policy", "token_ids": prompt, "sampling_params": {"seed": 9, **sampling}}


def test_call_k_of_a_session_samples_from_the_episode_seed(engine):
    prompt = [1, 5, 6, 7]
    with serve_engine(engine, PARAMS) as endpoint:
        url = endpoint.base_url.removesuffix("/v1") + GENERATE_PATH
        answers = [
            httpx.post(url, json=_body(prompt), headers={SESSION_HEADER: session}).json()
            for session in ("a", "a", "b")
        ]
        models = httpx.get(endpoint.base_url + "/models").json()
        recorded = endpoint.calls("a")
    expected = [
        engine.generate([prompt], PARAMS, [derive_seed("turn", 9, k)])[0] for k in (0, 1, 0)
    ]
    for answer, gen in zip(answers, expected, strict=True):
        choice = answer["choices"][0]
        assert choice["token_ids"] == gen.output_tokens
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == gen.logprobs
        assert [e["token"] for e in choice["logprobs"]["content"]] == [
            f"token_id:{t}" for t in gen.output_tokens
        ]
        assert choice["finish_reason"] == ("length" if gen.finish_reason == "length" else "stop")
        assert answer["prompt_token_ids"] == prompt
    assert answers[0] != answers[1]  # the second call of "a" draws other noise
    assert answers[2]["choices"] == answers[0]["choices"]  # "b" starts at call 0 again
    assert [c.output_tokens for c in recorded] == [
        expected[0].output_tokens,
        expected[1].output_tokens,
    ]
    assert models["data"][0]["id"] == "policy" and models["data"][0]["max_model_len"] == 4096


@pytest.mark.parametrize(
    ("body", "headers", "status", "reason"),
    [
        (_body([1, 5]), {}, 400, "X-Session-ID is required"),
        ({"token_ids": [1, 5], "sampling_params": {}}, None, 400, "seed"),
        (_body([1, 5], min_p=0.1), None, 400, "unsupported sampling parameters: ['min_p']"),
        (_body([1, 5], max_tokens=500), None, 400, "max_tokens over"),
        (_body([1, 5], temperature=-1), None, 400, "sampling_params.temperature"),
        (_body([1, 10**6]), None, 400, "outside"),
        (_body([]), None, 400, "non-empty list"),
        ({**_body([1]), "n": 2}, None, 400, "unsupported request fields"),
        (b"{not json", None, 400, "not JSON"),
        (b"x" * (5 << 20), None, 413, "body over"),
    ],
    ids=[
        "no-session",
        "no-seed",
        "min_p",
        "max_tokens",
        "temperature",
        "vocabulary",
        "empty",
        "n",
        "not-json",
        "oversized",
    ],
)
def test_bad_requests_are_refused_and_serving_goes_on(engine, body, headers, status, reason):
    with serve_engine(engine, PARAMS) as endpoint:
        url = endpoint.base_url.removesuffix("/v1") + GENERATE_PATH
        headers = {SESSION_HEADER: "s"} if headers is None else headers
        if isinstance(body, bytes):
            answer = httpx.post(url, content=body, headers=headers)
        else:
            answer = httpx.post(url, json=body, headers=headers)
        assert answer.status_code == status
        assert reason in answer.json()["error"]["message"]
        assert endpoint.calls("s") == []  # nothing sampled, nothing counted
        good = httpx.post(url, json=_body([1, 5]), headers={SESSION_HEADER: "s"})
        assert good.status_code == 200 and len(endpoint.calls("s")) == 1
