"""The one error hierarchy of swarmrl.

::

    SwarmError                      base of everything swarmrl raises on purpose
    ├── UserError                   the person running swarmrl must fix something; the CLI prints
    │   │                           one line (no traceback) and exits with status 2
    │   ├── ConfigError             unknown key, bad value, unreadable TOML
    │   ├── MissingPathError        a model directory, dataset or key file that is not there
    │   ├── DatasetError            a dataset row that cannot be used (names file and row)
    │   └── EngineUnavailable       the configured inference engine is not installed or cannot
    │                               load this model (names the install command or the reason)
    ├── PeerError                   an untrusted peer sent something wrong: reject it, record it,
    │   │                           penalise the peer; never crash, never silently accept
    │   ├── BadSignature            missing, malformed or forged signature; unknown key
    │   ├── ReplayedRequest         reused nonce or timestamp outside the window
    │   ├── BadProof                proof bundle null, truncated, oversized or inconsistent
    │   └── CorruptData             bytes whose digest does not match what was signed
    ├── VersionGone                 a weight version every source has pruned: it will not come
    │                               back, so retrying is pointless (not an InfraError)
    └── InfraError                  our own infrastructure failed: retry, back off, report
        ├── PeerUnavailable         a server we need did not answer in time
        └── WaitTimeout             a bounded wait ran out; the message says what it waited for

Rule of thumb: ``PeerError`` is about *who* (a peer misbehaved), ``InfraError`` about *what*
(a link or disk failed). Code that catches one never catches the other by accident.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class of every error swarmrl raises on purpose."""


class UserError(SwarmError):
    """Something the person running swarmrl must fix; shown as one line by the CLI."""


class ConfigError(UserError):
    """Unknown config key, bad value, or unreadable config file."""


class MissingPathError(UserError):
    """A file or directory the user named does not exist or cannot be read."""


class DatasetError(UserError):
    """A dataset row that cannot be used; the message names the file and row."""


class EngineUnavailable(UserError):
    """The configured inference backend is missing or cannot run this model."""


class PeerError(SwarmError):
    """An untrusted peer sent something wrong. Reject, record, penalise."""


class BadSignature(PeerError):
    """A signature is missing, malformed, forged, or made by a key we do not accept."""


class ReplayedRequest(PeerError):
    """A nonce was reused or a timestamp falls outside the accepted window."""


class BadProof(PeerError):
    """A proof bundle is null, truncated, oversized, non-finite or inconsistent."""


class CorruptData(PeerError):
    """Bytes whose digest does not match the signed one."""


class InfraError(SwarmError):
    """Our own infrastructure failed (network, disk, a dead process). Retry or report."""


class PeerUnavailable(InfraError):
    """A server we depend on did not answer in time."""


class WaitTimeout(InfraError):
    """A bounded wait ran out. The message says what was being waited for."""


class VersionGone(SwarmError):
    """A policy version that every answering source has pruned; it will never be served again."""
