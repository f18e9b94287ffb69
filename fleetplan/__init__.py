"""fleetplan: right-sizes a bare-metal GPU fleet serving LLMs.

One top-level name for the whole distribution. The packages live in the repository's own
directories and are linked in here:

- ``fleetplan.planner``, ``fleetplan.models``: the pure cores (no I/O, no clock);
- ``fleetplan.shared``: file utilities both adapters use (atomic writes, benchmark files);
- ``fleetplan.controller``, ``fleetplan.sim``: the adapters (daemon, agent; simulator, replay);
- ``fleetplan.harness``: the command line, the lab and the demo, above both.

``python -m fleetplan`` is the ``fleetplan`` command. The layers are import-linter contracts
(pyproject.toml, docs/architecture.md).
"""
