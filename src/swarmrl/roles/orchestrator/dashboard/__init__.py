"""The orchestrator's read-only web dashboard (``/ui``): run overview, nodes, weight versions,
ledger. ``app.build_dashboard`` builds the ASGI app; ``swarmrl dashboard RUN_DIR`` serves the
same app over a finished run."""
