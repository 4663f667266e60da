"""Operator commands: rooms, room, peers, peer, slots (inspection.py), top, doctor
and its host checks, their flags (commands.py), table formatting. They reach a daemon
only through its admin API."""
