"""The one log format of every swarmrl process: ``HH:MM:SS name: message`` on stderr.

Every role (orchestrator, trainer, relay, validator, worker) and the ``shardcast`` tools log
through :func:`configure_logging`, so a run's logs read alike whichever process wrote them.
Library chatter is kept out: HTTP client request lines, and the progress bars that
transformers and huggingface_hub draw while loading weights (in a log file a bar is one long
line of carriage returns, not progress).

Knows nothing about roles or what they log.
"""

from __future__ import annotations

import logging
import os
import re
import sys

_PLAIN_WORD = re.compile(r"[\w.+-]{1,64}", re.ASCII)

FORMAT = "%(asctime)s {name}: %(message)s"
DATE_FORMAT = "%H:%M:%S"
QUIET_LOGGERS = ("httpx", "httpcore", "uvicorn.access")


def silence_progress_bars() -> None:
    """No transformers / huggingface_hub progress bars in this process (nor its children)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when those libraries are imported
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:  # already imported: switch its bars off directly
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def configure_logging(name: str, level: str = "INFO") -> logging.Logger:
    """Log as ``HH:MM:SS name: message`` at ``level``; returns the ``swarmrl.<name>`` logger."""
    silence_progress_bars()
    logging.basicConfig(
        level=level.upper(),
        format=FORMAT.format(name=name),
        datefmt=DATE_FORMAT,
        force=True,
    )
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(f"swarmrl.{name}")


def plain(text: str) -> str:
    """``text`` as it is where it is one plain word (ASCII letters, digits, ``_.+-``; at most
    64), else quoted (``repr``): a name a peer chose (a node's engine) cannot break a log line
    or forge one."""
    return text if _PLAIN_WORD.fullmatch(text) else repr(text)
