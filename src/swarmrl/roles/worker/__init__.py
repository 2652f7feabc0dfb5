"""The worker role: the untrusted inference node (lease, generate, prove, submit)."""
