"""Ports for the servers a test starts (daemons, etcd, engines' servers)."""

from __future__ import annotations

import random
import socket

# Ports handed to servers a test starts come from below the kernel's ephemeral range:
# a port the kernel picked for bind(0) can be given again to any outgoing connection
# before the server binds it (an etcd start failed that way in CI).
_EPHEMERAL_LOW = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
_port_picker = random.Random()


def free_port(host: str = "127.0.0.1") -> int:
    for _ in range(200):
        port = _port_picker.randrange(10000, _EPHEMERAL_LOW)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} below {_EPHEMERAL_LOW} after 200 tries")
