"""Room logic per role (base.py shared, prefill.py, decode.py) and the pools the engine
registered (pools.py): decisions over the core's tables, no sockets and no threads."""
