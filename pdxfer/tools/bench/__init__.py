"""``pdxfer bench``: main.py runs it; args.py (its flags), plan.py (workloads, page
lists, blocks), raw.py (the reference processes), run.py (one run of one system),
report.py (tables and targets). Empty, so the CLI can read args.py without loading the rest."""
