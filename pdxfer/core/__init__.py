"""The pure core: messages, errors, config, the room and slot tables, transfer
arithmetic, the aux stamp, path choices. No I/O and no concurrency: no asyncio, ZMQ,
sockets, threads or transfer engine (tests/test_layers.py checks it)."""
