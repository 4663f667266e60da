"""Ending transfer sessions (Transport.rotate and end), on the real engine: what a
decode daemon's fencing rests on (proto/PROTOCOL.md, "Fencing").

A writer frozen with writes queued inside its transfer engine sends them when it
resumes. Once the receiving side ended the sessions those writes aim at, none of them
may land: here a writer process stops itself right after submitting, the target rotates
and ends the old sessions, the destination is filled as a new room would fill it, the
writer resumes, and every byte is checked. Both ways a daemon runs its engines: in its
own process (inline) and in a process of their own (isolated).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from pdxfer.core.config import load
from pdxfer.core.errors import Unsupported
from pdxfer.host.memory import SharedMemory
from pdxfer.transport import Status

from .conftest import needs_mooncake, settle

pytestmark = needs_mooncake

WRITES, WRITE_BYTES = 64, 1 << 20
REUSED = 0xA5

# A writer in a process of its own: it submits WRITES blocks of 1 MiB to the target's
# sessions, stops itself (SIGSTOP) with them queued in its engine, and once resumed
# waits for each to settle and prints how many completed and failed.
WRITER = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    from pdxfer.transport import Status
    from pdxfer.transport.mooncake import MooncakeTransport
    sessions, dst, writes, size = tuple(sys.argv[1].split(",")), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    writer = MooncakeTransport("127.0.0.1")
    writer.start()
    src = np.full(writes * size, 7, np.uint8)
    writer.register(int(src.ctypes.data), src.nbytes)
    handles = writer.submit(sessions, [int(src.ctypes.data) + i * size for i in range(writes)],
                            [dst + i * size for i in range(writes)], [size] * writes)
    os.kill(os.getpid(), signal.SIGSTOP)
    done = failed = 0
    for handle in handles:
        status = Status.FAILED if not handle else writer.poll(handle)
        deadline = time.monotonic() + 30
        while status is Status.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
            status = writer.poll(handle)
        done += status is Status.DONE
        failed += status is not Status.DONE
    print(done, failed, flush=True)
""")


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"


def wait_stopped(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not stopped(proc.pid):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the writer did not stop itself"
        time.sleep(0.005)


def inline_target():
    from pdxfer.transport.mooncake import MooncakeTransport

    return MooncakeTransport("127.0.0.1")


def isolated_target():
    from pdxfer.transport.isolated import IsolatedTransport

    lost = []
    return IsolatedTransport(load({"role": "decode", "host": "127.0.0.1"}), lambda sessions, current: lost.append(sessions))


@pytest.mark.parametrize("make_target", [inline_target, isolated_target], ids=["inline", "isolated"])
def test_writes_queued_by_a_frozen_writer_never_land_once_their_sessions_ended(make_target):
    target = make_target()
    dst = SharedMemory.create(WRITES * WRITE_BYTES, prefix="pdxfer-test-end")
    view = dst.array
    writer = None
    try:
        target.start()
        target.register(dst.address, dst.size)
        old = target.sessions
        writer = subprocess.Popen([sys.executable, "-c", WRITER, ",".join(old), str(dst.address), str(WRITES), str(WRITE_BYTES)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        wait_stopped(writer)
        new = target.rotate()
        assert new != old and target.sessions == new
        target.end(old)
        view[:] = REUSED  # what a new room writes into the pages once they are fenced
        os.kill(writer.pid, signal.SIGCONT)
        out, _ = writer.communicate(timeout=120)
        done, failed = map(int, out.split())
        time.sleep(0.2)
        changed = int(np.count_nonzero(view != REUSED))
        assert changed == 0, f"{changed} bytes landed after their sessions ended ({done} writes completed, {failed} failed)"
        assert failed > 0, f"every write completed before the sessions ended ({done}): the freeze caught nothing"
    finally:
        if writer is not None and writer.poll() is None:
            os.kill(writer.pid, signal.SIGCONT)
            writer.kill()
            writer.wait()
        target.close()
        dst.close()


@pytest.mark.parametrize("make_target", [inline_target, isolated_target], ids=["inline", "isolated"])
def test_rotated_sessions_receive_until_ended_and_the_new_ones_at_once(make_target):
    """A live peer keeps writing to the old sessions while it moves: they land until end()."""
    from pdxfer.transport.mooncake import MooncakeTransport

    target, writer = make_target(), MooncakeTransport("127.0.0.1")
    dst = SharedMemory.create(4 * 4096, prefix="pdxfer-test-end")
    view = dst.array
    src = np.arange(4096, dtype=np.uint8) % 251
    try:
        target.start()
        target.register(dst.address, dst.size)
        writer.start()
        writer.register(int(src.ctypes.data), src.nbytes)
        old = target.sessions
        new = target.rotate()

        def write(sessions, at: int) -> Status:
            (handle,) = writer.submit(sessions, [int(src.ctypes.data)], [dst.address + at * 4096], [4096])
            return settle(writer, handle, 20) if handle else Status.FAILED

        assert write(old, 0) is Status.DONE and np.array_equal(view[:4096], src)
        assert write(new, 1) is Status.DONE and np.array_equal(view[4096:8192], src)
        target.end(old)
        assert write(old, 2) is Status.FAILED and not view[8192:12288].any()
        assert write(new, 3) is Status.DONE and np.array_equal(view[12288:], src)
    finally:
        writer.close()
        target.close()
        dst.close()


def test_new_engines_never_take_a_port_an_ended_one_had(monkeypatch):
    """A writer frozen with writes for an ended engine's port would reach whatever
    listens there next: engines that come up on such a port are replaced at once."""
    from pdxfer.transport import mooncake

    target = mooncake.MooncakeTransport("127.0.0.1")
    real = mooncake.listening_ports
    try:
        target.start()
        first = target.ports
        assert first and first <= real()
        taken = next(iter(first))
        claims, calls = [1], []

        def listening(pid="self"):  # before and after each set of new engines: ``claims`` of the afters see the taken port
            calls.append(pid)
            ports = real(pid) - {taken}
            if len(calls) % 2 == 0 and claims[0] > 0:
                claims[0] -= 1
                ports |= {taken}
            return ports

        monkeypatch.setattr(mooncake, "listening_ports", listening)
        new = target.rotate()
        assert len(calls) == 4, "the engines that took the port were not replaced"
        assert target.sessions == new
        claims[0] = 1000
        with pytest.raises(Unsupported, match="took ports ended engines had"):
            target.rotate()
    finally:
        target.close()
