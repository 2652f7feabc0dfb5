"""Tools that look at or use a finished run: ``swarmrl serve`` (an OpenAI-compatible server
over a trained policy) and ``swarmrl dashboard`` (the read-only web dashboard of a run).

They sit on the launcher's floor: they read what runs leave behind and wire subsystems
together, and no role or subsystem imports them.
"""
