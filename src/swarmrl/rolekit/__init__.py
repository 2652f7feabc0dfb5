"""What every role process shares: command-line basics, logging, status reports, bounded
retries (``toolkit``); loading and swapping a fetched policy version (``policy``); starting,
watching and stopping role processes (``supervisor``).

Roles and the launcher import this package; no subsystem does.
"""
