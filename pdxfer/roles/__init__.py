"""Room logic per role: each role (prefill/, decode/) a service composed of named parts,
beside the parts both share (book.py: the room table and its fencing; lanes.py: what each
engine rank registered; engine.py: what both answer their engines; staging.py; ports.py
and inbound.py: what a role asks of the daemon, and the daemon of it). Decisions over
the core's tables, no sockets and no threads."""
