"""The sandboxed side of the assert harness (``swarmrl.envs.harness``), shipped as source: the
harness appends ``main(program, steps)`` and the sandbox runs the whole as its program.

``main`` reads the run's nonce from stdin, moves the program's stdout to stderr, runs the
program, then each step (evaluate a probe, or execute a test statement), writing one record per
step on a duplicate of the original stdout, each line ``<nonce> <JSON>``::

    ["setup", null | "<exception name>"]       after the program (a SystemExit is not an
                                               error: the steps then run on what it defined)
    [step, "ok", <encoded value or null>]      or [step, "error", "<exception name>"]
    ["end"]

then leaves with ``os._exit``, so no atexit handler or finaliser runs after the records. Values
are encoded by :func:`encode`: exact builtin types only, tagged so the trusted side rebuilds the
same types. Nothing here is trusted: the program shares this process and may replace any of
it; the trusted side reads the records strictly and compares the values itself.

Runs under the sandbox's interpreter (any Python 3.8+), imports only ``os`` and ``sys``, and
knows nothing of the tests' expected values: they never come here.
"""

import os
import sys

MAX_DEPTH = 64  # nesting of an encoded value
TAGS = {list: "l", tuple: "t", set: "S", frozenset: "F"}


def encode(value, depth=0):
    """``value`` as JSON text, or TypeError/ValueError when it is not a plain value.

    Written by hand rather than with ``json`` (whose import costs more than the rest of the
    runner): every leaf is a JSON literal, a decimal int below 2**63, or a hex string, so no
    escaping is needed. Strings travel as the hex of their UTF-8 bytes.
    """
    kind = type(value)
    if depth > MAX_DEPTH:
        raise ValueError(f"nested more than {MAX_DEPTH} deep")
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return str(value) if -(2**63) < value < 2**63 else tagged("i", f'"{value:x}"')
    if kind is float:
        return tagged("f", f'"{value.hex()}"')
    if kind is str:
        return tagged("s", f'"{value.encode("utf-8", "surrogatepass").hex()}"')
    if kind is bytes:
        return tagged("b", f'"{value.hex()}"')
    if kind is complex:
        return tagged("c", f'["{value.real.hex()}","{value.imag.hex()}"]')
    if kind in TAGS:
        items = ",".join([encode(item, depth + 1) for item in value])
        return tagged(TAGS[kind], f"[{items}]")
    if kind is dict:
        pairs = [f"[{encode(k, depth + 1)},{encode(v, depth + 1)}]" for k, v in value.items()]
        return tagged("d", "[" + ",".join(pairs) + "]")
    raise TypeError(f"a {kind.__name__} is not a plain value")


def tagged(tag, body):
    return '{"' + tag + '":' + body + "}"


def failure(exc):
    """The exception's class name, as a JSON string (letters, digits and _ only)."""
    name = "".join(c for c in str(type(exc).__name__)[:80] if c.isalnum() or c == "_")
    return f'"{name}"'


def main(program, steps):
    """Run ``program`` then ``steps`` ([kind, source] with kind "probe" or "exec")."""
    nonce = sys.stdin.readline().strip()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    channel = os.dup(1)  # not inherited by the program's subprocesses
    os.dup2(2, 1)  # the program's own stdout goes to stderr

    def send(record):
        data = (nonce + " " + record + "\n").encode()
        while data:
            data = data[os.write(channel, data) :]

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    namespace["__file__"] = globals().get("__file__", "main.py")
    try:
        exec(compile(program, "main.py", "exec"), namespace)
    except SystemExit:
        pass  # a program that ends itself (`unittest.main()`) is scored on what it defined
    except BaseException as exc:
        send(f'["setup",{failure(exc)}]')
        os._exit(0)
    send('["setup",null]')
    for index, (kind, source) in enumerate(steps):
        try:
            code = compile(source, "<test>", "eval" if kind == "probe" else "exec")
            if kind == "probe":
                record = f'[{index},"ok",{encode(eval(code, namespace))}]'
            else:
                exec(code, namespace)
                record = f'[{index},"ok",null]'
        except BaseException as exc:
            record = f'[{index},"error",{failure(exc)}]'
        send(record)
    send('["end"]')
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(0)
