"""The Mooncake transport's engine settings, seen on the real engine: tcp_lanes is
how many connections it writes to a peer over, and a transport with several engines
spreads its writes over every engine and every session of its peer."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from pdxfer.core.paths import TCP_LANES_ENV

from .conftest import needs_mooncake, settle

pytestmark = needs_mooncake

WRITES, WRITE_BYTES = 32, 256 * 1024


def established_by_remote_port() -> collections.Counter:
    """Established TCP connections of this process's network namespace, by remote port."""
    ports: collections.Counter = collections.Counter()
    with open("/proc/self/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            fields = line.split()
            if fields[3] == "01":  # ESTABLISHED
                ports[int(fields[2].rsplit(":", 1)[1], 16)] += 1
    return ports


def new_connections(engine_env: dict[str, str], writer_engines: int = 1, target_engines: int = 1) -> collections.Counter:
    """Write WRITES blocks at once from one transport to another, every byte checked;
    the connections opened to each port (a target engine's data port) meanwhile."""
    from pdxfer.transport import Status
    from pdxfer.transport.mooncake import MooncakeTransport

    writer = MooncakeTransport("127.0.0.1", engine_env=engine_env, engines=writer_engines)
    target = MooncakeTransport("127.0.0.1", engine_env=engine_env, engines=target_engines)
    src = np.arange(WRITES * WRITE_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    try:
        target.start()
        target.register(int(dst.ctypes.data), dst.nbytes)
        writer.start()
        writer.register(int(src.ctypes.data), src.nbytes)
        before = established_by_remote_port()
        offsets = [i * WRITE_BYTES for i in range(WRITES)]
        handles = writer.submit(target.sessions, [int(src.ctypes.data) + o for o in offsets],
                                [int(dst.ctypes.data) + o for o in offsets], [WRITE_BYTES] * WRITES)
        for handle in handles:
            assert settle(writer, handle, 20) is Status.DONE
        assert (dst == src).all()
        after = established_by_remote_port()
        return collections.Counter({port: after[port] - before[port] for port in after if after[port] > before[port]})
    finally:
        writer.close()
        target.close()


@pytest.mark.parametrize("lanes", [1, 3])
def test_the_engine_writes_to_a_peer_over_the_lanes_it_was_given(monkeypatch, lanes):
    monkeypatch.setenv(TCP_LANES_ENV, "2")  # the daemon's setting wins (and the test's environment is restored)
    assert max(new_connections({TCP_LANES_ENV: str(lanes)}).values()) == lanes


@pytest.mark.parametrize(("writer_engines", "target_engines"), [(2, 2), (1, 2), (3, 2)])
def test_writes_spread_over_every_session_of_the_peer(writer_engines, target_engines):
    """Each of the target's engines receives on a data port of its own: every one of
    them got connections, each engine of the writer opening its own lanes."""
    opened = new_connections({TCP_LANES_ENV: "1"}, writer_engines, target_engines)
    assert len(opened) == target_engines, opened
    assert sum(opened.values()) == max(writer_engines, target_engines), opened  # one lane per stripe


def test_a_probe_tries_every_route_to_the_peer():
    from pdxfer.transport import PROBE_BYTES
    from pdxfer.transport.mooncake import MooncakeTransport

    writer, target = MooncakeTransport("127.0.0.1", engines=2), MooncakeTransport("127.0.0.1", engines=2)
    try:
        sessions = target.start()
        writer.start()
        assert len(set(sessions)) == 2
        assert writer.probe(sessions, target.scratch + PROBE_BYTES)
        # One session that answers nobody: the probe fails though the other route works.
        assert not writer.probe((sessions[0], "127.0.0.1:1"), target.scratch + PROBE_BYTES)
    finally:
        writer.close()
        target.close()
