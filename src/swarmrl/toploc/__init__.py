"""Verifiable inference: TOPLOC hidden-state proofs plus sampling, termination, log-prob and
reward checks (DESIGN.md §5, docs/toploc.md).

Workers call ``toploc.bundle.build_bundles`` on generations with hidden states; validators call
``toploc.verify.Verifier.check`` / ``check_many``; ``swarmrl toploc calibrate`` measures honest
statistics and writes thresholds. The maths lives in ``poly`` (GF(65497)), ``encoding`` (chunk
layout and bytes) and ``stats``; wire types in ``swarmrl.protocol.proofs``.
"""
