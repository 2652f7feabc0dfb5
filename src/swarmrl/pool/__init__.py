"""swarmrl.pool: the orchestrator's compute pool service (DESIGN.md §7; docs/pool.md).

``app`` (HTTP routes) over ``service``/``work``/``penalties`` (the rules), ``scheduling`` and
``health`` (pure maths), ``db`` and ``store`` (state), ``client`` (what nodes, validators and the
trainer call). Imports nothing heavy here, so ``swarmrl pool`` starts fast.
"""
