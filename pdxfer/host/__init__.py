"""The host's resources: mapping engine memory (memory.py), yielding the cores to the
transfer engine (cpu_yield.py)."""
