"""The daemon process and the `pdxfer` command as a user meets them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import msgspec
import numpy as np
import pytest
import zmq

from pdxfer import client as client_module
from pdxfer.client import AsyncClient, Client, KVPool, _Requests
from pdxfer.core import config, errors
from pdxfer.core.plan import layout_registration
from pdxfer.core.protocol import AllocSlot, Codec, CudaIpcHandle, Error, GetStats, Heartbeat, Ok, Role, RoomAck, RoomState, RoomStatus
from pdxfer.daemon.prefill_side import PrefillDaemonPort
from pdxfer.daemon.server import Daemon
from pdxfer.host import memory
from pdxfer.roles.prefill import PrefillService
from pdxfer.tools.launch import LaunchError, start_daemon
from pdxfer.wire.batch import MAX_BATCH

from .conftest import needs_mooncake, orphan_pool, small_layout


def pdxfer(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdxfer", *args], capture_output=True, text=True, timeout=timeout)


def test_serve_help_explains_every_option_and_its_environment_variable():
    out = pdxfer("serve", "--help").stdout
    for name, _, desc in config.fields():
        flag = "--" + name.replace("_", "-")
        assert flag in out, flag
        assert f"PDXFER_{name.upper()}" in out.replace("\n", " ").replace(" ", ""), name
        assert desc.split()[0] in out


def test_serve_without_a_role_or_with_a_bad_value_says_what_is_wrong():
    missing = pdxfer("serve")
    assert missing.returncode == 2 and "role" in missing.stderr
    bad = pdxfer("serve", "--role", "decode", "--max-rooms", "many")
    assert bad.returncode == 2 and "--max-rooms is 'many'" in bad.stderr


@needs_mooncake
def test_daemon_without_the_device_it_was_asked_for_exits_saying_what_is_missing(runtime_dir, tmp_path):
    log = tmp_path / "cuda.log"
    with open(log, "w") as fh, pytest.raises(LaunchError, match="exited with code 1"):
        start_daemon("decode", runtime_dir, "--device", "cuda:0", stderr=fh, timeout=20)
    text = log.read_text()
    assert "cannot start" in text and "cuda" in text.lower()
    # D1: the device is bound before the transport starts, so no engine came up.
    assert "Transfer Engine" not in text


def _staging_rss(pid: int) -> int:
    """Bytes of a process's staging buffer mapping it has pages mapped for (smaps Rss)."""
    rss, inside = 0, False
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            if "-" in line.split(maxsplit=1)[0]:  # a mapping's first line: address range, perms, offset, dev, inode, path
                inside = "pdxfer-staging" in line
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
    return rss


@needs_mooncake
def test_staging_at_start_backs_the_buffer_and_maps_it_in_the_daemon_and_its_engine_process(daemons):
    lazy = daemons("decode", "--staging-mib", "8", name="lazy")
    eager = daemons("decode", "--staging-mib", "8", "--staging-at-start", name="eager")
    # As it starts, a daemon's buffer has no pages: its engine's threads would take a fault a page as legs land.
    assert _staging_rss(lazy.pid) == 0 and _staging_rss(lazy.ready["engine_pid"]) == 0
    # With --staging-at-start every page is there and mapped, where the engine writes and where the daemon copies.
    assert _staging_rss(eager.pid) == 8 << 20 and _staging_rss(eager.ready["engine_pid"]) == 8 << 20


@needs_mooncake
def test_daemon_refuses_unacknowledged_tcp_writes(runtime_dir, tmp_path):
    log = tmp_path / "proto.log"
    with open(log, "w") as fh, pytest.raises(LaunchError, match="exited with code 1"):
        start_daemon("prefill", runtime_dir, stderr=fh, timeout=20, env={"MC_TCP_PROTO": "1"})
    text = log.read_text()
    assert "cannot start" in text and "MC_TCP_PROTO=1" in text
    assert "Transfer Engine" not in text  # refused before an engine came up


@needs_mooncake
def test_gpu_pool_on_a_cpu_daemon_is_refused_with_what_it_needs(pair):
    _, decode = pair
    client = Client(decode.engine, timeout=10)
    client.connect()
    try:
        handle = CudaIpcHandle(handle=b"\0" * 64, size=1 << 20, device=0)
        with pytest.raises(errors.Unsupported, match="--device cuda:N"):
            client.register_kv([handle], *layout_registration(small_layout()))
    finally:
        client.close()


@needs_mooncake
def test_garbage_from_an_engine_gets_an_error_and_the_daemon_keeps_serving(engines):
    prefill = engines(engines.prefill_daemon, small_layout())
    decode = engines(engines.decode_daemon, small_layout())
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(engines.decode_daemon.engine)
    try:
        for junk in (b"", b"\xc1", b"\x81\xa4kind\xa5nope!", msgspec.msgpack.encode({"kind": "poll", "req": 1, "room": 0})):
            raw.send(junk)
            assert raw.poll(5000), "no reply to a malformed message"
            reply = msgspec.msgpack.decode(raw.recv(), type=Error)
            assert reply.code.value == "bad_message" and reply.message
    finally:
        raw.close(0)
    # Nothing changed and real rooms still work.
    slot = decode.alloc_slot()
    decode.expect(3, engines.prefill_daemon.bootstrap, np.array([1]), slot)
    s = prefill.alloc_slot()
    prefill.send(3, np.array([2]), 4, s, aux_bytes=0)
    assert decode.wait(3).state is RoomState.SUCCESS


@needs_mooncake
def test_requests_batched_in_one_zmq_message_each_get_their_reply_in_order(engines):
    engines(engines.decode_daemon, small_layout())
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(engines.decode_daemon.engine)
    codec = Codec()
    try:
        raw.send_multipart([codec.encode(GetStats(req=r)) for r in (11, 12, 13)] + [b"\xc1"])
        replies = []
        while len(replies) < 4:
            assert raw.poll(5000), f"only {len(replies)} replies to 4 batched requests"
            replies += [codec.engine_replies.decode(f) for f in raw.recv_multipart()]
        assert [type(r).__name__ for r in replies] == ["Stats", "Stats", "Stats", "Error"]
        assert [r.req for r in replies[:3]] == [11, 12, 13] and replies[3].code.value == "bad_message"
        raw.send_multipart([codec.encode(GetStats(req=20 + i)) for i in range(MAX_BATCH + 1)])
        assert raw.poll(5000)
        (reply,) = [codec.engine_replies.decode(f) for f in raw.recv_multipart()]
        assert isinstance(reply, Error) and reply.code.value == "bad_message" and str(MAX_BATCH) in reply.message
    finally:
        raw.close(0)


@needs_mooncake
def test_demo_command_runs_and_reports(tmp_path):
    result = pdxfer("demo", "--rooms", "24", "--in-flight", "8", "--layers", "2", "--pages", "256", "--max-tokens", "64", timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rooms succeeded     24 / 24" in result.stdout
    assert "0 mismatches" in result.stdout
    assert "p50" in result.stdout and "GB/s" in result.stdout


def test_a_client_keeps_rooms_its_daemon_releases_only_until_their_status_is_claimed(monkeypatch):
    """No release() forgets a room sent with release_when_settled: the client forgets
    its status once wait() or poll() handed it over settled, and keeps at most
    MAX_SELF_RELEASED such rooms for an engine that never asks (oldest out first).
    Before, every such room's status stayed for the life of the connection."""
    monkeypatch.setattr(client_module, "MAX_SELF_RELEASED", 2)
    requests, codec = _Requests("unused"), Codec()
    for room in (1, 2, 3):
        requests._posting(requests._send(room, [room], 4, (room, 1), 0, 1, False, True, 0, True, None))
        assert requests._incoming(codec.encode(RoomStatus(req=0, room=room, state=RoomState.SUCCESS, fenced=True))) is None
    assert list(requests._self_released) == [2, 3] and set(requests._status) == {2, 3}  # room 1 forgotten unclaimed
    unsettled = RoomStatus(req=0, room=2, state=RoomState.TRANSFERRING)
    assert requests._claimed(2, unsettled) is unsettled and 2 in requests._status  # only a settled status is the last word
    requests._claimed(3, requests._status[3])
    assert set(requests._status) == {2} and list(requests._self_released) == [2]
    requests._posting(requests._send(4, [4], 4, (4, 1), 0, 1, False, False, 0, True, None))  # the engine releases this one
    requests._incoming(codec.encode(RoomStatus(req=0, room=4, state=RoomState.SUCCESS, fenced=True)))
    requests._claimed(4, requests._status[4])
    assert 4 in requests._status  # kept for its release()


async def test_host_pools_are_mapped_off_the_event_loop_thread(monkeypatch, runtime_dir):
    """Populating a big pool takes seconds; on the loop's thread it would hold up every
    heartbeat and engine message meanwhile."""
    mapped_on = []
    open_handle = memory.open_handle

    def spy(handle):
        mapped_on.append(threading.get_ident())
        return open_handle(handle)

    monkeypatch.setattr(memory, "open_handle", spy)
    registered = []

    class Transport:  # what the daemon's port registers the pool with
        def register(self, address: int, length: int, populate: bool = True) -> None:
            registered.append(length)

    cfg = config.Config(role=Role.PREFILL, runtime_dir=runtime_dir)
    port = PrefillDaemonPort(Daemon(cfg, Transport()), lambda room, left, now: None, None, None, None, "cpu")
    service = PrefillService(cfg, "i" * 16, port, sessions=(), bootstrap_address="")
    pool = KVPool.create(small_layout())
    try:
        request = _Requests("unused")._pool_registration(pool)
        reply = await service.on_engine(b"engine", request)
        assert isinstance(reply, Ok), reply
        assert registered == [pool.memory.size]
        assert mapped_on and threading.get_ident() not in mapped_on
    finally:
        for mapping in service.lanes.held_mappings():
            mapping.close()
        pool.close()


@needs_mooncake
async def test_an_engine_message_whose_handler_raises_is_counted_and_the_daemon_keeps_serving(runtime_dir):
    """A bug in a handler must not kill the engine channel (H1), and an operator must
    see it: pdxfer_errors{reason="task:engine-message"}, also in stats()."""
    daemon = Daemon(config.Config(role=Role.DECODE, runtime_dir=runtime_dir))
    await daemon.start()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    client = AsyncClient(daemon.engine_endpoint, timeout=5)
    try:
        handle = daemon.service.on_engine

        def buggy(identity, msg):
            if msg.req == 7:
                raise RuntimeError("a bug in a handler")
            return handle(identity, msg)

        daemon.service.on_engine = buggy
        raw.connect(daemon.engine_endpoint)
        raw.send(Codec().encode(GetStats(req=7)))
        await client.connect()
        deadline = asyncio.get_running_loop().time() + 5
        while (await client.stats()).failures.get("task:engine-message", 0) == 0:
            assert asyncio.get_running_loop().time() < deadline, "the handler's failure was not counted"
            await asyncio.sleep(0.01)
        assert (await client.stats()).failures["task:engine-message"] == 1
        daemon.side._dropped([Heartbeat(seq=1), RoomAck(room=5)])  # about no live room
        assert (await client.stats()).failures["dropped:peer-message"] == 2
    finally:
        raw.close(0)
        await client.close()
        await daemon.stop()


async def test_concurrent_slot_requests_share_a_grant_instead_of_hearing_busy(daemons):
    """Engines start many requests at once: the first grant takes every free slot
    (slot_batch), so the other callers' own requests meet an empty table. They take
    that grant's spares; before, each slept a Busy retry (20 ms) for nothing."""
    d = daemons("decode", name="d")
    client = AsyncClient(d.engine, slot_batch=4)
    await client.connect()
    try:
        await client.create_aux_buffer(4, 64)
        slots = await asyncio.gather(*(client.alloc_slot() for _ in range(4)))
        assert len({index for index, _ in slots}) == 4
        with pytest.raises(errors.Busy):  # a fifth has nothing to share
            await client.alloc_slot()
    finally:
        await client.close()


async def test_concurrent_slot_requests_go_to_the_daemon_one_at_a_time(daemons, monkeypatch):
    """Callers that find no slot at hand while a request for slots is out wait for its
    grant instead of each asking: with few slots free, each of their own requests
    would be granted one or two (a round trip per room). The next request asks for
    as many as wait then, and every caller hears Busy when the daemon has none left."""
    d = daemons("decode", name="d")
    client = AsyncClient(d.engine, slot_batch=2)
    await client.connect()
    asked, out = [], []
    call = client._call

    async def counting(msg):
        if not isinstance(msg, AllocSlot):
            return await call(msg)
        out.append(msg)
        asked.append((msg.count, len(out)))  # slots asked for, requests out at once
        try:
            return await call(msg)
        finally:
            out.remove(msg)

    monkeypatch.setattr(client, "_call", counting)
    try:
        await client.create_aux_buffer(6, 64)
        slots = await asyncio.gather(*(client.alloc_slot() for _ in range(5)))
        assert len({index for index, _ in slots}) == 5
        assert asked == [(2, 1), (3, 1)]  # the first caller's batch, then one request for the three still waiting
        asked.clear()
        results = await asyncio.gather(*(client.alloc_slot() for _ in range(3)), return_exceptions=True)
        assert isinstance(results[0], tuple)  # the table's last free slot
        assert all(isinstance(r, errors.Busy) for r in results[1:])  # one more request, refused for both callers left
        assert asked == [(2, 1), (2, 1)]
        await client.free_slot(slots[0])
        assert (await client.alloc_slot())[0] == slots[0][0]  # nothing is stuck after a refusal
    finally:
        await client.close()


async def test_requests_that_do_not_wait_raise_their_refusal_in_wait(daemons):
    """AsyncClient: a refused expect(wait=False) is raised by wait() for its room,
    whether wait() came before the refusal or after; a request the socket could not
    queue is refused with Busy the same way."""
    d = daemons("decode", name="d")
    client = AsyncClient(d.engine, timeout=5)
    await client.connect()
    try:
        await client.create_kv_pool(small_layout())
        await client.create_aux_buffer(4, 64)
        slot = await client.alloc_slot()
        await client.expect(3, "127.0.0.1:1", np.array([1, 256]), slot, wait=False)
        with pytest.raises(errors.PageOutOfRange) as exc:
            await client.wait(3)
        assert exc.value.room == 3
        waiting = asyncio.ensure_future(client.wait(4))
        await asyncio.sleep(0)
        await client.expect(4, "127.0.0.1:1", np.array([300]), slot, wait=False)
        with pytest.raises(errors.PageOutOfRange, match="page index 300"):
            await waiting
        # A full queue cannot be made here on demand: hand the request to the
        # socket's drop callback, as the socket does when its queue is full.
        lost = client._expect(5, "127.0.0.1:1", np.array([1]), slot, 0, None, False, 0, None)
        client._posting(lost)
        client._dropped(None, [client.codec.encode(lost)])
        with pytest.raises(errors.Busy, match="queue to the daemon") as exc:
            await client.wait(5)
        assert exc.value.room == 5
    finally:
        await client.close()


def test_a_pool_larger_than_shared_memory_is_refused_before_anything_is_mapped():
    """Faulting in a pool past /dev/shm's room ends in SIGBUS or the OOM killer, with
    the pages left behind; the engine gets a clear error instead, and no file."""
    before = set(os.listdir(memory.SHM_DIR))
    too_big = memory.room_for_pools() + 2**30
    with pytest.raises(errors.InsufficientCapacity, match="does not fit in shared memory"):
        memory.SharedMemory.create(too_big, prefix="pdxfer-test")
    assert set(os.listdir(memory.SHM_DIR)) - before == set()


def test_pools_of_engines_that_exited_are_swept_and_live_or_foreign_ones_kept():
    """An engine killed before it removes its pools leaves their names in /dev/shm, holding
    memory nobody will free; the next pool created (or bench) removes exactly those."""
    orphans = [orphan_pool(memory.KV_POOL_PREFIX, 8192), orphan_pool(memory.AUX_BUFFER_PREFIX, 4096)]
    dead_pid = os.path.basename(orphans[0]).split("-")[2]
    kept = [os.path.join(memory.SHM_DIR, name) for name in (
        f"{memory.KV_POOL_PREFIX}-{os.getpid()}-0badf00d",  # this process is alive
        f"someone-else-{dead_pid}-0badf00d",  # not an engine pool of ours
        f"{memory.KV_POOL_PREFIX}-x{dead_pid}-0badf00d",  # no pid where the pid goes
    )]
    for path in kept:
        open(path, "wb").close()
    try:
        removed = memory.sweep_orphans()
        assert {os.path.basename(p): n for p, n in zip(orphans, (8192, 4096))}.items() <= removed.items()
        assert not any(os.path.exists(p) for p in orphans)
        assert all(os.path.exists(p) for p in kept)
        assert not {os.path.basename(p) for p in kept} & removed.keys()
    finally:
        for path in orphans + kept:
            if os.path.exists(path):
                os.unlink(path)
