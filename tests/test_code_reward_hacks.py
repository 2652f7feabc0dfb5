"""The code environment's reward cannot be won without solving the problem: each known reward
hack (docs/tasks.md, "Reward hacks") scores 0 and honest programs still score, in every sandbox
mode that starts here (``bwrap`` when bubblewrap works, ``unshare`` where the sandbox has it and
the kernel lets it start, ``rlimit`` when the tests run as root)."""

import json
import os
import typing

import pytest

from swarmrl.envs.code import CodeEnv
from swarmrl.envs.sandbox import Limits, Sandbox, SandboxMode
from swarmrl.errors import SandboxError

LIMITS = Limits(cpu_s=1, wall_s=3.0)
MBPP_ROWS = [
    {"text": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]},
    {
        "text": "Write area(r), the area of a circle.",
        "test_list": [
            "assert math.isclose(area(2), 12.566, rel_tol=1e-3)",
            "assert math.isclose(area(1), 3.1416, rel_tol=1e-3)",
        ],
    },
    {
        "text": "Write perimeter(r), the perimeter of a circle.",
        "test_list": ["assert abs(perimeter(1) - 6.2832) < 0.001"],
    },
    {
        "text": "Write common(a, b), the elements in both.",
        "test_list": ["assert set(common((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))"],
    },
    {"text": "Write is_odd(n).", "test_list": ["assert is_odd(3)", "assert not is_odd(2)"]},
    {"text": "Write upto(n), 0..n-1 lazily.", "test_list": ["assert list(upto(3)) == [0, 1, 2]"]},
    {
        "text": "Write thrice(s) (a HumanEval-style check).",
        "test_list": "def check(candidate):\n    assert candidate('a') == 'aaa'\n"
        "    assert candidate('') == ''\n\ncheck(thrice)\n",
    },
    {
        "text": "Write a class Point(x, y) whose points are equal when their coordinates are.",
        "test_list": [
            "assert Point(1, 2) == Point(1, 2)",
            "assert Point(1, 2) != Point(2, 1)",
            "assert Point(3, 4).x == 3",
        ],
    },
    {
        "text": "Write twice(s) (a test block).",
        "test_list": "import math\nx = 'ab'\nassert twice(x) == 'abab'\n"
        "def check(candidate):\n    assert candidate('') == ''\ncheck(twice)\n",
    },
]
APPS_ROWS = [
    {
        "question": "Read n and print n squared.",
        "input_output": {"inputs": ["3\n", "10\n", "0\n"], "outputs": ["9\n", "100\n", "0\n"]},
    },
    {"question": "Print the input back.", "input_output": {"inputs": ["a\n"], "outputs": ["a\n"]}},
]
HONEST = {
    "add": "def add(a, b):\n    print('adding', a, b)\n    return a + b\n",
    "area": "import math\n\ndef area(r):\n    return math.pi * r * r\n",
    "perimeter": "import math\n\ndef perimeter(r):\n    return 2 * math.pi * r\n",
    "common": "def common(a, b):\n    return [x for x in a if x in b]\n",
    "is_odd": "def is_odd(n):\n    return n % 2 == 1\n",
    "Point": "from dataclasses import dataclass\n\n@dataclass\nclass Point:\n    x: int\n"
    "    y: int\n",
    "thrice": "def thrice(s):\n    return s * 3\n",
    "upto": "def upto(n):\n    yield from range(n)\n\nimport sys\nsys.exit(0)\n",
    "twice": "def twice(s):\n    return s + s\n\nif __name__ == '__main__':\n"
    "    print(twice('x'))\n",
}


@pytest.fixture(scope="module", params=["bwrap", "unshare", "rlimit"])
def sandbox(request):
    if request.param not in typing.get_args(SandboxMode):
        pytest.skip(f"this sandbox has no {request.param} mode")
    if request.param == "rlimit" and os.geteuid() != 0:
        pytest.skip("rlimit mode isolates processes and files only when run as root")
    try:
        return Sandbox(LIMITS, request.param)
    except SandboxError as exc:
        pytest.skip(f"{request.param} sandbox unavailable here: {exc}")


@pytest.fixture(scope="module")
def mbpp(sandbox, tmp_path_factory):
    path = tmp_path_factory.mktemp("mbpp") / "mbpp.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in MBPP_ROWS))
    return CodeEnv(path, sandbox, 0.5, problem_column="text", tests_column="test_list")


@pytest.fixture(scope="module")
def apps(sandbox, tmp_path_factory):
    path = tmp_path_factory.mktemp("apps") / "apps.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in APPS_ROWS))
    return CodeEnv(path, sandbox, 0.5, problem_column="question", tests_column="input_output")


def _score(env, function, program):
    """The score of ``program`` on the problem that asks for ``function``."""
    task = next(
        env.task_for_id(i) for i in range(env.space_size()) if f" {function}(" in env.problem(i)[0]
    )
    return env.score(task, f"```python\n{program}```")


@pytest.mark.parametrize("function", sorted(HONEST))
def test_honest_programs_score_one(mbpp, function):
    score = _score(mbpp, function, HONEST[function])
    assert (score.reward, score.details["correct"], score.details["channel"]) == (
        1.0,
        True,
        "complete",
    )
    assert score.details["passed"] == score.details["tests"] >= 1


def test_wrong_programs_score_zero_with_the_tests_they_passed(mbpp):
    half = _score(mbpp, "add", "def add(a, b):\n    return 3\n")  # right for add(1, 2) only
    assert (half.reward, half.details["passed"], half.details["tests"]) == (0.0, 1, 2)
    odd = _score(mbpp, "is_odd", "def is_odd(n):\n    return True\n")
    assert (odd.reward, odd.details["passed"]) == (0.0, 1)
    block = _score(mbpp, "twice", "def twice(s):\n    return s * 3\n")
    assert (block.reward, block.details["passed"]) == (0.0, 1)  # twice('') == '' holds
    loop = _score(mbpp, "add", "def add(a, b):\n    while True:\n        pass\n")
    assert loop.reward == 0.0 and loop.details["verdict"] == "timeout"
    assert _score(mbpp, "add", "def add(a, b)\n    return a + b\n").reward == 0.0  # syntax


# Each: (the function the problem asks for, a program that tries to pass without solving it).
ASSERT_HACKS = {
    "exit early": ("add", "import sys\nsys.exit(0)\n"),
    "os._exit": ("add", "import os\nos._exit(0)\n"),
    "SystemExit from the function": ("add", "def add(a, b):\n    raise SystemExit(0)\n"),
    "os._exit in atexit": (
        "add",
        "import atexit, os\natexit.register(os._exit, 0)\n\n"
        "def add(a, b):\n    raise SystemExit(1)\n",
    ),
    "os._exit in a finaliser": (
        "add",
        "import os\n\nclass Bye:\n    def __del__(self):\n        os._exit(0)\n\n"
        "keep = Bye()\n\ndef add(a, b):\n    raise SystemExit(1)\n",
    ),
    "SystemExit while the failure is reported": (
        "add",
        "import sys\n\nclass Leave:\n    def write(self, text):\n        raise SystemExit(0)\n"
        "    def flush(self):\n        pass\n\n"
        "sys.stderr = Leave()\n\ndef add(a, b):\n    return 0\n",
    ),
    "math.isclose monkeypatched": (
        "area",
        "import math\nmath.isclose = lambda *a, **k: True\n\ndef area(r):\n    return 0\n",
    ),
    "abs redefined": (
        "perimeter",
        "def abs(x):\n    return 0\n\ndef perimeter(r):\n    return 0\n",
    ),
    "builtins.set patched": (
        "common",
        "import builtins\n\nclass Same:\n    def __eq__(self, other):\n        return True\n"
        "    def __hash__(self):\n        return 0\n\n"
        "builtins.set = lambda *a: Same()\n\ndef common(a, b):\n    return []\n",
    ),
    "os._exit inside a check() block": (
        "thrice",
        "import os\n\ndef thrice(s):\n    os._exit(0)\n",
    ),
    "SystemExit inside a check() block": (
        "thrice",
        "def thrice(s):\n    raise SystemExit(0)\n",
    ),
    "os._exit in atexit after SystemExit(1) inside a check() block": (
        "thrice",
        "import atexit, os\natexit.register(os._exit, 0)\n\n"
        "def thrice(s):\n    raise SystemExit(1)\n",
    ),
    "always-equal object in a check() block": (
        "thrice",
        "class Eq:\n    def __eq__(self, other):\n        return True\n\n"
        "def thrice(s):\n    return Eq()\n",
    ),
    "always-equal object": (
        "add",
        "class Eq:\n    def __eq__(self, other):\n        return True\n\n"
        "def add(a, b):\n    return Eq()\n",
    ),
    "always-equal int subclass": (
        "add",
        "class Eq(int):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\n\ndef add(a, b):\n    return Eq(0)\n",
    ),
    "always-equal class under test": (
        "Point",
        "class Point:\n    def __init__(self, *a):\n        self.x = Point\n"
        "    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return True\n",
    ),
    "always-false object for `assert not`": (
        "is_odd",
        "class Flip:\n    n = 0\n    def __bool__(self):\n        Flip.n += 1\n"
        "        return Flip.n == 1\n\ndef is_odd(n):\n    return Flip()\n",
    ),
    "reading the tests from disk": (
        "add",
        "import os, re, sys\n\ntext = ''\n"
        "here = os.path.dirname(os.path.abspath(sys.modules['__main__'].__file__))\n"
        "for folder in (here, os.path.dirname(here), os.getcwd()):\n"
        "    for name in os.listdir(folder)[:50]:\n"
        "        try:\n"
        "            text += open(os.path.join(folder, name), errors='replace').read()\n"
        "        except OSError:\n"
        "            pass\n\n"
        "def add(a, b):\n"
        "    found = re.search(r'add\\(%d, %d\\) == (-?\\d+)' % (a, b), text)\n"
        "    return int(found.group(1)) if found else None\n",
    ),
    "printing fake records from a thread": (
        "add",
        "import sys, threading\n\ndef fake():\n"
        "    for line in ('[\"setup\", null]', '[0, \"ok\", true]', '[1, \"ok\", true]',\n"
        "                 '[\"end\"]', 'PASSED'):\n"
        "        print(line, flush=True)\n\n"
        "threading.Thread(target=fake).start()\n\ndef add(a, b):\n    return None\n",
    ),
    "forging the result channel": (
        "add",
        "import json, os, sys\n\nharness = sys._getframe(1).f_locals\n"
        "nonce, channel = harness['nonce'], harness['channel']\n"
        "records = [['setup', None], [0, 'ok', True], [1, 'ok', True], ['end']]\n"
        "for record in records:\n"
        "    os.write(channel, (nonce + ' ' + json.dumps(record) + '\\n').encode())\n"
        "os._exit(0)\n",
    ),
    "forging records before the harness's own": (
        "add",
        "import json, os, sys\n\nharness = sys._getframe(1).f_locals\n"
        "os.write(harness['channel'], (harness['nonce'] + ' [\"setup\", null]\\n').encode())\n\n"
        "def add(a, b):\n    return a + b\n",
    ),
    "killing the harness and its parent": (
        "add",
        "import os, signal\n\nfor pid in (os.getppid(), 0, os.getpid()):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n",
    ),
}


@pytest.mark.parametrize("hack", sorted(ASSERT_HACKS))
def test_assert_style_reward_hacks_score_zero(mbpp, hack):
    function, program = ASSERT_HACKS[hack]
    score = _score(mbpp, function, program)
    assert (score.reward, score.details["correct"]) == (0.0, False), score.details
    assert score.details["verdict"] != "timeout"  # the hack ran to its end
    assert _score(mbpp, "add", HONEST["add"]).reward == 1.0  # the scorer lives on


def test_forged_or_cut_channels_are_named_in_the_details(mbpp):
    forged = _score(mbpp, "add", ASSERT_HACKS["forging records before the harness's own"][1])
    assert forged.details["channel"] == "forged"
    early = _score(mbpp, "add", ASSERT_HACKS["os._exit"][1])
    assert early.details["channel"] == "incomplete" and early.details["passed"] == 0


def _squared(apps):
    return next(
        apps.task_for_id(i) for i in range(apps.space_size()) if "squared" in apps.problem(i)[0]
    )


STDIO_HACKS = {
    "exit early": "import sys\nsys.exit(0)\n",
    "os._exit": "import os\nos._exit(0)\n",
    "printing the expected output found on disk or in other processes": (
        "import glob, json, os, sys\n\nn = sys.stdin.read().strip()\nseen = ''\n"
        "paths = glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ')\n"
        "for folder in (os.getcwd(), os.path.dirname(os.getcwd()), '/task', '/tmp'):\n"
        "    if os.path.isdir(folder):\n"
        "        paths += [os.path.join(folder, f) for f in os.listdir(folder)[:50]]\n"
        "for path in paths:\n"
        "    try:\n"
        "        if os.path.isfile(path):\n"
        "            seen += open(path, errors='replace').read(100000)\n"
        "    except OSError:\n"
        "        pass\n"
        "start = seen.find('{\"inputs\"')\n"
        "while start >= 0:\n"
        "    try:\n"
        "        cases = json.JSONDecoder().raw_decode(seen, start)[0]\n"
        "    except ValueError:\n"
        "        cases = {}\n"
        "    for given, wanted in zip(cases.get('inputs', []), cases.get('outputs', [])):\n"
        "        if given.strip() == n:\n"
        "            print(wanted)\n"
        "            sys.exit(0)\n"
        "    start = seen.find('{\"inputs\"', start + 1)\n"
    ),
}


@pytest.mark.parametrize("hack", sorted(STDIO_HACKS))
def test_stdin_stdout_reward_hacks_score_zero(apps, hack):
    score = apps.score(_squared(apps), f"```python\n{STDIO_HACKS[hack]}```")
    assert (score.reward, score.details["correct"]) == (0.0, False), score.details
    assert score.details["verdict"] != "timeout"  # the hack ran to its end


def test_stdin_stdout_honest_programs_keep_partial_credit(apps):
    task = _squared(apps)
    right = apps.score(task, "```python\nn = int(input())\nprint(n * n)\n```")
    assert (right.reward, right.details["correct"]) == (1.0, True)
    half = apps.score(task, "```python\nn = int(input())\nprint(n * n if n < 5 else 0)\n```")
    assert half.reward == pytest.approx(2 / 3) and half.details["passed"] == 2
