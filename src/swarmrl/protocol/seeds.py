"""The one seeding rule: every seed in swarmrl is a pure function of a label and some numbers.

    derive_seed(p1, …, pk) = first 63 bits of sha256("swarmrl-seed-v1:" + "p1:…:pk")

where each part is written as Python's ``str`` of an int (base 10, ``-`` for negatives) or as
the text itself, and the first 63 bits are the top 63 bits of the first 8 digest bytes read
big-endian. The first part is a label naming what the seed is for. Seeds of the swarm are part
of the protocol (a worker samples with them and a validator replays with them; both sign over
them in the proof binding), so any implementation in any language must follow this exactly:

    task_i of a work unit  = derive_seed("task", pool_seed, secret, node_id, counter, i)
                             mod task_count
    work unit seed         = derive_seed("unit", pool_seed, secret, node_id, counter)
    sample i of a unit     = derive_seed("sample", unit_seed, i)      (tasks in lease order, G each)

and the learning library uses the same rule with its own labels (``"rollout"``, ``"tasks"``,
``"eval"``, ``"filter"``; see ``swarmrl.trainer``), so one seed (``run.seed``) reproduces a
colocated run exactly. Text parts must not contain ``:`` (the separator), so two different
part lists never hash the same text.

Knows nothing about what the seeds drive.
"""

from __future__ import annotations

import hashlib

SEED_DOMAIN = "swarmrl-seed-v1"


def derive_seed(*parts: int | str) -> int:
    """A seed in ``[0, 2^63)`` that is a pure function of ``parts`` (module docstring)."""
    texts = []
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, int | str):
            raise TypeError(f"seed parts are ints or text, got {part!r}")
        text = str(part)
        if ":" in text:
            raise ValueError(f"seed part {text!r} contains ':', the separator")
        texts.append(text)
    digest = hashlib.sha256(":".join([SEED_DOMAIN, *texts]).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sample_seed(unit_seed: int, sample_index: int) -> int:
    """Sampling seed of sample ``sample_index`` of a work unit (tasks in lease order, G each)."""
    return derive_seed("sample", unit_seed, sample_index)
