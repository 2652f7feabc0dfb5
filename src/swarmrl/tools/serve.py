"""``swarmrl serve RUN_DIR|CHECKPOINT``: try a trained policy with any OpenAI client.

    swarmrl serve runs/arith-20260101-120000 [--host 127.0.0.1] [--port 8000]
                  [--engine torch|vllm] [--name NAME] [--device cpu] [--dtype float32]
                  [--threads N] [--api-key KEY] [--max-body-bytes N] [--max-tokens-limit N] …

The policy is found by ``swarmrl.tools.checkpoint.find_policy`` (a checkpoint, a run's final
``policy/``, or the newest version a swarm run's trainer published). ``--engine torch`` (the
default) serves ``/v1/completions`` and ``/v1/chat/completions`` from
``swarmrl.tools.openai_api``, bounded by ``swarmrl.config.serve.ServeLimits`` (one flag per
limit) and, with ``--api-key`` (or ``$SWARMRL_API_KEY``), open only to clients that send it.
``--engine vllm`` hands the directory to vLLM's own OpenAI-compatible server (it must be
installed; the key goes to it as ``$VLLM_API_KEY``, the limits are vLLM's own). A LoRA version
(base + ``lora/``, ``swarmrl.inference.lora``) is served with its adapter merged, like workers
run it: the torch engine merges in memory; for vLLM, which loads a directory and nothing else,
the merged checkpoint is written once under ``--merged-dir`` (default
``$XDG_CACHE_HOME/swarmrl/merged``, one directory per adapter and base, reused by later
serves). Serves until interrupted.

Knows how to start a server; the routes are ``swarmrl.tools.openai_api``'s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from swarmrl.config.serve import ServeLimits
from swarmrl.errors import UserError
from swarmrl.tools.checkpoint import find_policy

API_KEY_ENV = "SWARMRL_API_KEY"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmrl serve",
        description="serve a trained policy with an OpenAI-compatible API",
    )
    parser.add_argument("path", help="run directory or HF checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 = any free port")
    parser.add_argument("--port-file", default=None, help="write the bound port here")
    parser.add_argument("--engine", choices=("torch", "vllm"), default="torch")
    parser.add_argument("--name", default="", help="model name clients ask for (default: dir)")
    parser.add_argument("--device", default="cpu", help="torch engine device (cpu, cuda)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's, one a core); 1 suits a tiny policy on "
        "a busy machine, where idle threads spinning cost more than they give",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}; the "
        "environment keeps it out of the process list, which other users can read)",
    )
    limits = parser.add_argument_group("limits (torch engine; see swarmrl.config.serve)")
    for name, spec in ServeLimits.model_fields.items():
        limits.add_argument(
            "--" + name.replace("_", "-"),
            dest=f"limit_{name}",
            type=spec.annotation,  # int or float
            metavar="SECONDS" if spec.annotation is float else "N",
            default=spec.default,
            help=f"{spec.description} (default: {spec.default})",
        )
    parser.add_argument(
        "--merged-dir",
        default=None,
        help="where --engine vllm writes a LoRA version merged (default: "
        "$XDG_CACHE_HOME/swarmrl/merged)",
    )
    return parser


def model_name(path: Path, policy: Path) -> str:
    """The served name: the run directory's name (or the checkpoint's)."""
    return (path if path != policy else policy).resolve().name


def merged_checkpoint(policy: Path, root: Path) -> Path:
    """``policy`` as vLLM must load it: itself, or for a LoRA version its merged copy under
    ``root``, named by a digest of the adapter and base files and written whole or not at all
    (a serve stopped while merging leaves only a ``.partial`` directory, cleared next time)."""
    from swarmrl.inference.lora import ADAPTER_DIR, has_adapter, write_merged

    if not has_adapter(policy):
        return policy
    digest = hashlib.sha256()
    for item in sorted(p for p in (policy / ADAPTER_DIR).iterdir() if p.is_file()):
        digest.update(item.name.encode() + b"\0" + item.read_bytes())
    target = root / digest.hexdigest()[:32]
    if (target / "config.json").is_file():
        return target
    partial = root / f"{target.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    write_merged(policy, partial)
    partial.rename(target)
    return target


def default_merged_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "swarmrl" / "merged"


def exec_vllm(policy: Path, name: str, args: argparse.Namespace) -> None:
    """Replace this process with vLLM's OpenAI server over ``policy`` (merged if LoRA)."""
    from swarmrl.inference.interface import require_backend

    require_backend("vllm")
    root = Path(args.merged_dir).expanduser() if args.merged_dir else default_merged_dir()
    served = merged_checkpoint(policy, root)
    if served != policy:
        print(f"serving {policy} with its LoRA adapter merged, from {served}", flush=True)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(served)]
    argv += ["--served-model-name", name, "--host", args.host, "--port", str(args.port)]
    argv += ["--dtype", args.dtype]
    if args.api_key:  # vLLM's own server checks it; from the environment, not the argv
        os.environ["VLLM_API_KEY"] = args.api_key
    os.execv(sys.executable, argv)


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    if args.engine == "vllm" and (args.port == 0 or args.port_file):
        # vLLM's server binds its own socket after this process is replaced, so there is no
        # moment at which the bound port is known here to report it truthfully
        raise UserError("--engine vllm needs a fixed --port (not 0) and takes no --port-file")
    limits = serve_limits(args)
    path = Path(args.path).expanduser()
    policy = find_policy(path)
    name = args.name or model_name(path, policy)
    if args.engine == "vllm":
        exec_vllm(policy, name, args)
    from swarmrl.inference.engine import TorchEngine
    from swarmrl.inference.lora import apply_adapter, has_adapter
    from swarmrl.model.io import load_policy
    from swarmrl.protocol.http_limits import HttpLimits, uvicorn_options
    from swarmrl.serving import ThreadServer
    from swarmrl.tools.openai_api import build_app
    from swarmrl.tools.openai_policy import Policy
    from swarmrl.tools.openai_wire import openai_refusal

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(policy, dtype=args.dtype, device=args.device)
    if has_adapter(policy):  # a published LoRA version: its base with the adapter merged in
        apply_adapter(model, policy)
    engine = TorchEngine(model, tokenizer, args.device)
    served = Policy(engine, tokenizer, name)
    app = build_app(served, limits, args.api_key)
    # the HTTP layer holds the same body limits as the app (it answers first when a body is
    # chunked or lies about its length), and refuses in the OpenAI error form too
    guard = HttpLimits(
        max_head_bytes=limits.max_head_bytes,
        head_timeout_s=limits.head_timeout_s,
        max_body_bytes=limits.max_body_bytes,
        body_timeout_s=limits.body_timeout_s,
        refusal=openai_refusal,
    )
    server = ThreadServer(app, args.host, args.port, name="serve", **uvicorn_options(guard))
    server.start()
    key = "an API key" if args.api_key else "no API key (anyone who reaches the port may use it)"
    print(f"serving {name!r} from {policy} at {server.url}/v1, {key}", flush=True)
    try:
        server.run_until_stopped(args.port_file)
    finally:
        served.close()
    return 0


def serve_limits(args: argparse.Namespace) -> ServeLimits:
    """The ``--max-…`` flags as :class:`ServeLimits`; a bad value is one line naming its flag."""
    values = {name: getattr(args, f"limit_{name}") for name in ServeLimits.model_fields}
    try:
        return ServeLimits(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if first["loc"]:  # one flag's value; else a rule between flags, named in the message
            message = f"--{str(first['loc'][0]).replace('_', '-')}: {message}"
        raise UserError(message) from None
