"""Test and demonstration tooling: the demo, simulated engines, process launching,
chaos engines, the soak, the benchmark. Nothing else in pdxfer imports from here
(but the ``pdxfer`` command, which dispatches to them)."""
