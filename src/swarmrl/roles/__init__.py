"""The five roles, one package each: ``orchestrator``, ``trainer``, ``worker``, ``validator``,
``relay``. A role package holds the process wiring of that role only (arguments, config, the
main loop that calls the subsystems); roles never import each other and no subsystem imports
a role. What crosses between roles is defined in :mod:`swarmrl.protocol`.
"""
