"""The assert harness's two trusted halves without a sandbox: what the tests are split into (the
expected values stay here) and how a run's channel is read (strictly: only the harness's
records, in order, holding plain values)."""

import json
import time

import pytest

from swarmrl.envs.harness import judge, plan, program

NONCE = "n0nce"
TESTS = (
    "import math\n"
    "assert add(1, 2) == 3\n"
    "assert math.isclose(area(2), 12.566, rel_tol=1e-3)\n"
    "assert set(common((3, 4), (4,))) == set((4, 5))\n"
    "assert not is_odd(2)\n"
    "assert sorted(words(7), key=len, reverse=True) == ['abc', 'de']\n"
    "assert abs(pi_ish(1) - 3.1416) < 0.001\n"
    "assert Point(1, 2) == Point(1, 2)\n"
)


def _s(text):
    """A string as the runner encodes it."""
    return {"s": text.encode().hex()}


def _channel(*records, nonce=NONCE, end=True):
    lines = [["setup", None], *records] + ([["end"]] if end else [])
    return "".join(f"{nonce} {json.dumps(r)}\n" for r in lines)


def test_only_the_parts_that_need_the_program_enter_the_sandbox():
    split = plan(TESTS)
    assert [(s.kind, s.source) for s in split.steps] == [
        ("exec", "import math"),
        ("probe", "add(1, 2)"),
        ("probe", "area(2)"),
        ("probe", "set(common((3, 4), (4,)))"),
        ("probe", "is_odd(2)"),
        ("probe", "words(7)"),
        ("probe", "pi_ish(1)"),
        ("probe", "Point(1, 2) == Point(1, 2)"),  # the program's own __eq__ is under test
    ]
    assert split.tests == 7  # the import is setup, not a test
    source = program("def add(a, b):\n    return a + b\n", split)
    for expected in ("== 3", "12.566", "(4, 5)", "'abc'", "3.1416", "0.001"):
        assert expected not in source


def test_a_humaneval_style_checker_is_split_like_top_level_asserts():
    block = (
        "METADATA = {'author': 'x'}\n\n"
        "def check(candidate):\n"
        "    import math\n"
        "    assert candidate('a') == 'aaa'\n"
        "    assert math.isclose(candidate(0.5), 1.5)\n\n"
        "check(thrice)\n"
    )
    split = plan(block)
    assert [(s.kind, s.source) for s in split.steps] == [
        ("exec", "METADATA = {'author': 'x'}"),
        ("exec", "import math"),
        ("probe", "thrice('a')"),
        ("probe", "thrice(0.5)"),
    ]
    assert split.tests == 2
    assert "'aaa'" not in program("", split) and "1.5" not in program("", split)
    values = [None, None, _s("aaa"), {"f": (1.5).hex()}]
    assert judge(split, _channel(*([i, "ok", v] for i, v in enumerate(values))), NONCE).correct
    # a checker something else uses is still defined there (and its calls still inlined)
    used = plan(block + "also = check\n")
    assert any(s.source.startswith("def check(candidate)") for s in used.steps)
    assert ("probe", "thrice('a')") in [(s.kind, s.source) for s in used.steps]
    # a checker with a loop cannot be split: it runs in the sandbox as one step
    loop = plan("def check(c):\n    for i in range(3):\n        assert c(i) == i\ncheck(f)\n")
    assert [s.kind for s in loop.steps] == ["exec", "exec"] and loop.tests == 1


def test_records_with_the_right_values_pass_and_wrong_types_fail():
    split = plan(TESTS)
    values = [
        None,  # import math
        3,
        {"f": (4 * 3.14159265).hex()},
        {"S": [4, 5]},
        False,
        {"l": [_s("de"), _s("abc")]},
        {"f": (3.14159).hex()},
        True,
    ]
    good = _channel(*([i, "ok", v] for i, v in enumerate(values)))
    outcome = judge(split, good, NONCE)
    assert (outcome.correct, outcome.passed, outcome.tests, outcome.channel) == (
        True,
        7,
        7,
        "complete",
    )
    as_tuple = [
        *values[:5],
        {"t": [_s("de"), _s("abc")]},
        *values[6:],
    ]  # sorted() of a tuple is a list
    assert judge(split, _channel(*([i, "ok", v] for i, v in enumerate(as_tuple))), NONCE).correct
    as_string = [values[0], _s("3"), *values[2:]]  # "3" is not 3
    wrong = judge(split, _channel(*([i, "ok", v] for i, v in enumerate(as_string))), NONCE)
    assert (wrong.correct, wrong.passed) == (False, 6)


def test_a_channel_that_is_cut_short_or_forged_fails():
    split = plan("assert add(1, 2) == 3\nassert add(0, 0) == 0\n")
    ok = [[0, "ok", 3], [1, "ok", 0]]
    assert judge(split, _channel(*ok), NONCE).correct
    cut = judge(split, _channel(*ok, end=False), NONCE)
    assert (cut.correct, cut.passed, cut.channel) == (False, 2, "incomplete")
    half_line = _channel(*ok)[:-3]  # the end record's line cut off: that record is missing
    assert judge(split, half_line, NONCE).channel == "incomplete"
    raised = judge(split, _channel([0, "ok", 3], [1, "error", "SystemExit"]), NONCE)
    assert (raised.correct, raised.passed) == (False, 1)
    forgeries = {
        "no nonce": _channel(*ok, nonce="guess"),
        "a line of the program's own": "PASSED\n" + _channel(*ok),
        "a record twice": _channel(ok[0], ok[0], ok[1]),
        "out of order": _channel(ok[1], ok[0]),
        "after the end": _channel(*ok) + f"{NONCE} {json.dumps([0, 'ok', 3])}\n",
        "an untagged float": _channel([0, "ok", 3.0], ok[1]),
        "an untagged string": _channel([0, "ok", "3"], ok[1]),
        "an unknown tag": _channel([0, "ok", {"obj": "Eq"}], ok[1]),
        "an unknown status": _channel([0, "pass", None], ok[1]),
        "not JSON": f"{NONCE} [\"setup\", null]\n{NONCE} [0, 'ok', 3]\n",
    }
    for name, stdout in forgeries.items():
        outcome = judge(split, stdout, NONCE)
        assert (outcome.correct, outcome.passed, outcome.channel) == (False, 0, "forged"), name


def test_values_from_the_sandbox_cannot_make_the_scorer_build_huge_objects():
    """Unbounded, these take a 2 TB string (MemoryError), minutes of big-int arithmetic and
    a 1 GB string; bounded, each check fails at once."""
    split = plan("assert 'ab' * n(1) == 'x'\nassert 3 ** h(1) == 4\nassert g(1) % 1 == ''\n")
    values = [10**12, 10**8, _s("%0999999999d")]
    start = time.monotonic()
    outcome = judge(split, _channel(*([i, "ok", v] for i, v in enumerate(values))), NONCE)
    assert (outcome.correct, outcome.passed, outcome.channel) == (False, 0, "complete")
    assert time.monotonic() - start < 5


def test_plain_values_round_trip_exactly_and_nothing_else_is_encoded():
    from swarmrl.envs.harness.channel import _decode
    from swarmrl.envs.harness.runner import encode

    values = [None, True, 0, -(2**70), 7**6000, 0.1, float("inf"), 1 + 2j, 's"\\\n\ud800é']
    values += [b"\x00"]
    values += [[1, (2, 3)], (), {1: {"a": [b"x"]}}, {1.5, "b"}, frozenset({(1, 2)})]
    for value in values:
        back = _decode(json.loads(encode(value)), 0)
        assert back == value and type(back) is type(value), value

    class Eq(int):
        def __eq__(self, other):
            return True

    for strange in (Eq(1), [Eq(1)], {"k": object()}, iter([1]), len):
        with pytest.raises(TypeError):
            encode(strange)


def test_test_code_the_harness_cannot_use_is_a_one_line_dataset_error(tmp_path):
    from swarmrl.envs.code import parse_tests
    from swarmrl.errors import DatasetError

    assert parse_tests(["assert f(1) == 2"], "row 1").asserts == "assert f(1) == 2"
    for bad, message in (
        (["assert f(1) = 2"], "row 3: the test code is not valid Python 3"),
        ("import math\nx = 1\n", "row 3: the test code has no assert and no test call"),
    ):
        with pytest.raises(DatasetError, match=message) as info:
            parse_tests(bad, "row 3")
        assert "\n" not in str(info.value)
