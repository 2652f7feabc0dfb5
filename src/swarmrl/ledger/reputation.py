"""A node's reputation from its record: a smoothed acceptance rate.

    reputation = 0                                           if the node is banned
               = (accepted + 1) / (accepted + soft + 3·hard + 2)   otherwise

``accepted`` counts accepted submissions, ``soft`` soft invalidations (late or dropped units),
``hard`` hard rejections. The +1/+2 (Laplace) prior puts a newcomer at 0.5; a hard rejection
weighs three soft ones. Pure; knows nothing about where the counts come from.
"""

from __future__ import annotations


def reputation(accepted: int, soft: int, hard: int, banned: bool) -> float:
    """Reputation in [0, 1] (see module docstring)."""
    if banned:
        return 0.0
    return (accepted + 1) / (accepted + soft + 3 * hard + 2)
