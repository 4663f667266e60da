"""The Mooncake transport's engine settings, seen on the real engine: tcp_lanes is
how many connections it writes to a peer over."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from pdxfer.paths import TCP_LANES_ENV

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


def connections_used(engine_env: dict[str, str]) -> int:
    """Write WRITES blocks at once from one engine to another; the most new
    connections opened to any one port (the target's data port)."""
    from pdxfer.transport import Status
    from pdxfer.transport.mooncake import MooncakeTransport

    writer, target = MooncakeTransport("127.0.0.1", engine_env=engine_env), MooncakeTransport("127.0.0.1")
    src = np.arange(WRITES * WRITE_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    try:
        target.start()
        target.register(int(dst.ctypes.data), dst.nbytes)
        writer.start()
        writer.register(int(src.ctypes.data), src.nbytes)
        before = established_by_remote_port()
        offsets = [i * WRITE_BYTES for i in range(WRITES)]
        handles = writer.submit(target.session, [int(src.ctypes.data) + o for o in offsets],
                                [int(dst.ctypes.data) + o for o in offsets], [WRITE_BYTES] * WRITES)
        for handle in handles:
            assert settle(writer, handle, 20) is Status.DONE
        assert (dst == src).all()
        after = established_by_remote_port()
        return max((after[port] - before[port] for port in after), default=0)
    finally:
        writer.close()
        target.close()


@pytest.mark.parametrize("lanes", [1, 3])
def test_the_engine_writes_to_a_peer_over_the_lanes_it_was_given(monkeypatch, lanes):
    monkeypatch.setenv(TCP_LANES_ENV, "2")  # the daemon's setting wins (and the test's environment is restored)
    assert connections_used({TCP_LANES_ENV: str(lanes)}) == lanes
