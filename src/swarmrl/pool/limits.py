"""Rate limits of the orchestrator: a token bucket per pool for admitting new identities.

A bucket holds at most ``burst`` tokens and refills at ``rate_per_s``; admitting one new node
takes a token. Fresh keys cost nothing to make, so without a limit one peer could flood a pool
(and its ledger) with identities, or rejoin at once under a new key after a ban. Buckets live in
memory: a restart refills them, which costs an attacker one burst. Knows nothing about HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    """``take(now)`` returns 0 when a token was taken, else the seconds until one is there."""

    rate_per_s: float
    burst: int
    tokens: float = -1.0  # -1: full on first use
    last_s: float = 0.0

    def take(self, now: float) -> float:
        if self.tokens < 0:
            self.tokens, self.last_s = float(self.burst), now
        self.tokens = min(self.burst, self.tokens + (now - self.last_s) * self.rate_per_s)
        self.last_s = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s
