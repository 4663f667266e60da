"""Daemons and engines in separate processes, KV moved for real by the Mooncake
transfer engine over TCP on loopback, every destination byte checked."""

from __future__ import annotations

import numpy as np
import pytest

from pdxfer.core import errors
from pdxfer.core.protocol import Layout, RoomState
from pdxfer.host.processes import socket_inodes
from pdxfer.tools.launch import read_events, start_sim

from .conftest import needs_mooncake, small_layout
from .roomkit import wait_until

pytestmark = [needs_mooncake, pytest.mark.integration]

SMALL = ["--layers", "4", "--page-size", "8", "--token-bytes", "64", "--pages", "1024", "--max-tokens", "96"]


def run_sims(prefill, decode, rooms: int, in_flight: int, *common: str, decode_flags=(), timeout=300.0):
    flags = ["--rooms", str(rooms), "--in-flight", str(in_flight), "--slots", str(2 * in_flight), *SMALL, *common]
    procs = {
        "prefill": start_sim("prefill", prefill.engine, *flags, "--room-timeout", "60"),
        "decode": start_sim("decode", decode.engine, "--bootstrap", prefill.bootstrap, *flags, "--room-timeout", "60", *decode_flags),
    }
    summaries = read_events(procs, timeout=timeout)
    assert set(summaries) == {"prefill", "decode"}, f"an engine died: {summaries}"
    return summaries["prefill"], summaries["decode"]


def test_thousand_rooms_32_in_flight_every_byte_verified(pair):
    prefill, decode = pair
    pre, dec = run_sims(prefill, decode, 1000, 32)
    assert dec["mismatches"] == 0
    assert dec["outcome"] == {"success": 1000}, dec["outcome"]
    assert pre["outcome"] == {"success": 1000}, pre["outcome"]
    assert dec["bytes"] > 0


@pytest.mark.parametrize("prefill_engines, decode_engines", [(2, 2), (1, 3), (3, 1)])
def test_writes_spread_over_the_engines_of_both_daemons(daemons, prefill_engines, decode_engines):
    """Each daemon announces one session per transfer engine; a prefill writes over its
    engines and the decode daemon's (paths.stripes), whatever the two counts."""
    prefill = daemons("prefill", "--tcp-engines", str(prefill_engines), "--inline-kv-bytes", "0")
    decode = daemons("decode", "--tcp-engines", str(decode_engines), "--inline-kv-bytes", "0")
    for daemon, count in ((prefill, prefill_engines), (decode, decode_engines)):
        sessions = daemon.ready["sessions"]
        assert len(set(sessions)) == count and sessions[0] == daemon.ready["session"], daemon.ready
    pre, dec = run_sims(prefill, decode, 64, 16, "--seed", "3")
    assert dec["mismatches"] == 0
    assert dec["outcome"] == {"success": 64} and pre["outcome"] == {"success": 64}, (pre["outcome"], dec["outcome"])
    # Every decode engine received: each has a data port of its own with lanes accepted on it.
    handshake = {int(s.rsplit(":", 1)[1]) for s in decode.ready["sessions"]}
    receiving = accepting_ports(decode.ready["engine_pid"]) - handshake
    assert len(receiving) == decode_engines, (receiving, handshake)


def accepting_ports(pid: int) -> set[int]:
    """Ports a process listens on that hold established connections (accepted ones)."""
    sockets = socket_inodes(pid)
    listening, established = set(), set()
    for table in ("tcp", "tcp6"):  # the engine listens on IPv6's any address
        with open(f"/proc/{pid}/net/{table}") as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                port = int(fields[1].rsplit(":", 1)[1], 16)
                if fields[3] == "0A" and fields[9] in sockets:  # LISTEN, ours
                    listening.add(port)
                elif fields[3] == "01":  # ESTABLISHED
                    established.add(port)
    return listening & established


@pytest.mark.parametrize("aux_path, inline", [("tcp", "0"), ("tcp", "65536"), ("transfer_engine", "0")])
@pytest.mark.parametrize("layout", [x.value for x in Layout])
def test_every_layout_and_aux_path(daemons, layout, aux_path, inline):
    """Every layout, aux path, and (with the aux record over TCP) KV inline or not."""
    prefill = daemons("prefill", "--aux-path", aux_path, "--inline-kv-bytes", inline)
    decode = daemons("decode", "--aux-path", aux_path, "--inline-kv-bytes", inline)
    pre, dec = run_sims(prefill, decode, 48, 16, "--layout", layout, "--seed", "7")
    assert dec["mismatches"] == 0
    assert dec["outcome"] == {"success": 48}, dec["outcome"]
    assert pre["outcome"] == {"success": 48}, pre["outcome"]


def test_faulty_rooms_fail_with_their_reason_and_the_rest_succeed(daemons):
    # The prefill side of a room the decode engine could not even start only learns
    # of it through its bootstrap timeout, kept short here.
    prefill = daemons("prefill", "--bootstrap-timeout", "3")
    decode = daemons("decode")
    faults = ["--fault", "small:7", "--fault", "out_of_range:11", "--fault", "stale:13"]
    # Drafts of a whole page make every room need two pages, so 'small' can take one away.
    pre, dec = run_sims(prefill, decode, 200, 16, "--draft-tokens", "8", decode_flags=faults)
    by_fault = dec["by_fault"]
    assert dec["mismatches"] == 0
    assert by_fault["none"] == {"success": sum(by_fault["none"].values())}, by_fault
    assert by_fault["small"] == {"failed:insufficient_capacity": sum(by_fault["small"].values())}, by_fault
    assert by_fault["out_of_range"] == {"error:page_out_of_range": sum(by_fault["out_of_range"].values())}, by_fault
    assert by_fault["stale"] == {"error:stale_memory_version": sum(by_fault["stale"].values())}, by_fault
    # Every prefill room ended: Success, its peer's capacity failure, or a timeout.
    assert sum(pre["outcome"].values()) == 200
    assert set(pre["outcome"]) <= {"success", "failed:insufficient_capacity", "failed:timeout"}, pre["outcome"]


def _known_failed(client, room: int) -> bool:
    try:
        return client.poll(room).state is RoomState.FAILED
    except errors.UnknownRoom:
        return False


def _fill_room(prefill, room: int, pages: np.ndarray, tokens: int, seed: int, **send_flags):
    """Write a recognisable pattern into the prefill pages and aux slot, and send();
    return what the decode side must see (per-region page bytes, aux bytes)."""
    rng = np.random.default_rng(seed)
    expected = []
    for arr in prefill.kv.arrays():
        data = rng.integers(0, 256, size=(pages.size, arr.shape[1]), dtype=np.uint8)
        arr[pages] = data
        expected.append(data)
    slot = prefill.alloc_slot()
    aux = rng.integers(0, 256, size=48, dtype=np.uint8)
    prefill.aux.payload(slot)[:48] = aux
    prefill.send(room, pages, tokens, slot, aux_bytes=48, **send_flags)
    return expected, aux.tobytes()


def test_engine_clients_move_torch_tensors(engines):
    torch = pytest.importorskip("torch", reason="torch views need torch")
    prefill = engines(engines.prefill_daemon, small_layout())
    decode = engines(engines.decode_daemon, small_layout())
    src_pages, dst_pages = np.array([3, 4, 5, 9]), np.array([100, 7, 8, 200])
    # Write through the torch views the engine would use.
    for i, t in enumerate(prefill.kv.tensors()):
        assert t.dtype is torch.bfloat16 and t.shape == (256, 4, 32)
        t[torch.from_numpy(src_pages)] = torch.full((4, 4, 32), float(i + 1), dtype=torch.bfloat16)
    slot_d = decode.alloc_slot()
    decode.expect(42, engines.prefill_daemon.bootstrap, dst_pages, slot_d)
    slot_p = prefill.alloc_slot()
    prefill.aux.payload(slot_p)[:5] = np.frombuffer(b"hello", np.uint8)
    prefill.send(42, src_pages, 16, slot_p, aux_bytes=5)
    assert decode.wait(42).state is RoomState.SUCCESS
    assert prefill.wait(42).state is RoomState.SUCCESS
    for i, t in enumerate(decode.kv.tensors()):
        assert torch.all(t[torch.from_numpy(dst_pages)] == float(i + 1))
        assert torch.all(t[0] == 0)  # pages not named stay untouched
    assert bytes(decode.aux.payload(slot_d)[:5]) == b"hello"
    decode.release(42)
    prefill.release(42)


def test_send_before_expect_and_expect_before_send(engines):
    prefill = engines(engines.prefill_daemon, small_layout(Layout.PAGE_FIRST))
    decode = engines(engines.decode_daemon, small_layout(Layout.PAGE_FIRST))
    boot = engines.prefill_daemon.bootstrap
    # prefill first
    expected, aux = _fill_room(prefill, 1, np.array([10, 11]), 8, seed=1)
    assert prefill.poll(1).state is RoomState.BOOTSTRAPPING
    slot = decode.alloc_slot()
    decode.expect(1, boot, np.array([20, 30]), slot)
    assert decode.wait(1).state is RoomState.SUCCESS
    assert np.array_equal(decode.kv.arrays()[0][[20, 30]], expected[0])
    assert bytes(decode.aux.payload(slot)[:48]) == aux
    # decode first
    slot2 = decode.alloc_slot()
    decode.expect(2, boot, np.array([40]), slot2)
    status = decode.poll(2)
    assert status.state in (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT)
    expected, aux = _fill_room(prefill, 2, np.array([12]), 3, seed=2)
    assert decode.wait(2).state is RoomState.SUCCESS
    assert np.array_equal(decode.kv.arrays()[0][[40]], expected[0])
    assert prefill.wait(1).state is RoomState.SUCCESS and prefill.wait(2).state is RoomState.SUCCESS


def test_requests_that_do_not_wait_get_no_ok_and_their_refusal_at_wait(engines):
    """send()/expect() with wait=False: the daemon answers a good request with
    nothing, a bad one with its error pushed for the room, which wait() and poll()
    raise. poll() answers without asking the daemon: bootstrapping, the room's status
    until anything came, then the refusal."""
    prefill = engines(engines.prefill_daemon, small_layout())
    decode = engines(engines.decode_daemon, small_layout())
    boot = engines.prefill_daemon.bootstrap
    slot = decode.alloc_slot()
    decode.expect(30, boot, np.array([1, 256]), slot, wait=False)
    with pytest.raises(errors.PageOutOfRange, match="page index 256") as exc:
        decode.wait(30)
    assert exc.value.room == 30
    decode.free_slot(slot)  # never bound: the room was refused
    bad_slot = prefill.alloc_slot()
    prefill.send(30, np.array([-1]), 4, bad_slot, wait=False)

    def refused() -> bool:
        try:
            assert prefill.poll(30).state is RoomState.BOOTSTRAPPING
        except errors.PageOutOfRange as exc:
            assert "page index -1" in str(exc) and exc.room == 30
            return True
        return False

    wait_until(refused, 10, "the refusal of room 30's send()")
    prefill.free_slot(bad_slot)
    # A good room with neither side waiting moves as usual.
    dslot = decode.alloc_slot()
    decode.expect(31, boot, np.array([3, 4]), dslot, wait=False)
    while decode._sock.poll(300):  # no ok comes: what does is pushed (the room's waiting_for_input)
        assert decode._take(decode._sock.recv_multipart()) == []
    wait_until(lambda: decode.poll(31).state is RoomState.WAITING_FOR_INPUT, 10, "room 31 waiting for the prefill engine's send()")
    expected, aux = _fill_room(prefill, 31, np.array([7, 8]), 8, seed=9, wait=False)
    assert decode.wait(31).state is RoomState.SUCCESS and prefill.wait(31).state is RoomState.SUCCESS
    assert np.array_equal(decode.kv.arrays()[0][[3, 4]], expected[0])
    assert decode.aux.read(dslot, 31)[:48] == aux
    decode.release(31)
    prefill.release(31)


def test_a_room_sent_with_release_when_settled_is_released_by_its_daemon(engines):
    """Once its settled status is pushed (Success, or Failed and fenced), the prefill
    daemon drops the room and frees its slot; the engine sends no release()."""
    prefill = engines(engines.prefill_daemon, small_layout(), slots=2)
    decode = engines(engines.decode_daemon, small_layout())
    boot = engines.prefill_daemon.bootstrap
    decode.expect(40, boot, np.array([1, 2]), decode.alloc_slot(), wait=False)
    _fill_room(prefill, 40, np.array([5, 6]), 8, seed=10, wait=False, release_when_settled=True)
    assert prefill.wait(40).state is RoomState.SUCCESS
    _fill_room(prefill, 41, np.array([9]), 4, seed=11, wait=False, release_when_settled=True)  # no decode side yet
    assert prefill._sock.poll(300) == 0  # no ok came (and the room cannot move yet)
    prefill.abort(41, "request cancelled")
    assert prefill.wait(41).state is RoomState.FAILED
    assert not prefill._status and not prefill._self_released  # (private) the client keeps nothing of them either
    stats = prefill.stats()
    assert sum(stats.rooms.values()) == 0, stats.rooms
    assert stats.slots.get("free") == 2, stats.slots  # both slots back in the pool
    assert prefill.poll(40).state is RoomState.SUCCESS  # from the daemon's memory of finished rooms
    with pytest.raises(errors.UnknownRoom):
        prefill.release(40)
    assert decode.wait(40).state is RoomState.SUCCESS
    decode.release(40)


def test_a_decode_of_another_page_size_is_refused_naming_both(engines):
    """Pages move whole (A9): a prefill refuses at the handshake a decode daemon whose
    ranks use a page size none of its own does, and the decode's rooms there fail."""
    prefill = engines(engines.prefill_daemon, small_layout(page_size=4))
    decode = engines(engines.decode_daemon, small_layout(page_size=8))
    slot = decode.alloc_slot()
    decode.expect(5, engines.prefill_daemon.bootstrap, np.array([1]), slot)
    status = decode.wait(5)
    assert status.state is RoomState.FAILED and status.code == "compat_mismatch"
    assert "page_size: prefill=4 decode=8" in status.reason
    assert prefill.kv is not None  # the prefill side is unaffected and still serves


def test_compat_mismatch_fails_the_room_naming_the_difference(engines):
    """Other fields are compared as the decode's request comes, when the prefill rank has
    registered (a decode daemon serves many ranks: another layout fails rooms, not its
    hello), so before the prefill engine computes. Both sides fail it: the decode at once,
    the prefill engine at its send()."""
    prefill = engines(engines.prefill_daemon, small_layout(dtype="bfloat16"))
    decode = engines(engines.decode_daemon, small_layout(dtype="float16"))
    difference = "incompatible KV layout: dtype: prefill='bfloat16' decode='float16'"
    slot = decode.alloc_slot()
    decode.expect(6, engines.prefill_daemon.bootstrap, np.array([1]), slot)
    status = decode.wait(6)
    assert status.state is RoomState.FAILED and status.code == "compat_mismatch" and difference in status.reason, status
    source_slot = prefill.alloc_slot()
    with pytest.raises(errors.CompatMismatch) as refused:
        prefill.send(6, np.array([2]), 4, source_slot)
    assert difference in refused.value.message, refused.value
    prefill.free_slot(source_slot)
    assert prefill.stats().peers == 1  # the decode daemon is still its peer


def test_out_of_range_page_fails_only_its_room(engines):
    prefill = engines(engines.prefill_daemon, small_layout())
    decode = engines(engines.decode_daemon, small_layout())
    boot = engines.prefill_daemon.bootstrap
    slot = decode.alloc_slot()
    with pytest.raises(errors.PageOutOfRange) as exc:
        decode.expect(7, boot, np.array([1, 256]), slot)
    assert "page index 256 at position 1" in str(exc.value) and "0..255" in str(exc.value)
    with pytest.raises(errors.PageOutOfRange, match="page index -1"):
        prefill.send(7, np.array([-1]), 4, prefill.alloc_slot())
    # A good room on the same daemons still succeeds.
    decode.expect(8, boot, np.array([1, 2]), slot)
    _fill_room(prefill, 8, np.array([5, 6]), 8, seed=3)
    assert decode.wait(8).state is RoomState.SUCCESS


def test_too_small_destination_fails_at_bootstrap_with_clear_error(engines):
    prefill = engines(engines.prefill_daemon, small_layout())
    decode = engines(engines.decode_daemon, small_layout())
    boot = engines.prefill_daemon.bootstrap
    slot = decode.alloc_slot()
    # 8 prompt tokens fit 2 pages of 4, but 3 draft tokens need a third page.
    decode.expect(9, boot, np.array([1, 2]), slot, num_draft_tokens=3)
    _fill_room(prefill, 9, np.array([5, 6]), 8, seed=4)
    status = decode.wait(9)
    assert status.state is RoomState.FAILED and status.code == "insufficient_capacity"
    assert "8 prompt + 3 draft = 11" in status.reason
    assert decode.kv.arrays()[0][[1, 2]].sum() == 0  # not a byte moved
    assert prefill.wait(9).state is RoomState.FAILED
    # With room for the drafts it succeeds.
    decode.expect(10, boot, np.array([1, 2, 3]), decode.alloc_slot(), num_draft_tokens=3)
    _fill_room(prefill, 10, np.array([5, 6]), 8, seed=5)
    assert decode.wait(10).state is RoomState.SUCCESS


def test_relocation_between_plan_and_use_fails_the_room_before_bytes_move(engines):
    prefill = engines(engines.prefill_daemon, small_layout())
    decode = engines(engines.decode_daemon, small_layout())
    boot = engines.prefill_daemon.bootstrap
    slot = decode.alloc_slot()
    decode.expect(11, boot, np.array([1, 2]), slot)
    assert decode.reregister_kv() == 2  # the engine relocated its pages
    status = decode.wait(11)
    assert status.state is RoomState.FAILED and status.code == "stale_memory_version"
    assert "memory version 1 -> 2" in status.reason
    # The prefill hears of it over the bootstrap channel, which the decode engine's
    # wait() does not wait for (its request never left: the room is fenced at once).
    wait_until(lambda: _known_failed(prefill, 11), 10.0, "the prefill daemon hearing that room 11 failed")
    with pytest.raises(errors.PdxferError) as exc:
        _fill_room(prefill, 11, np.array([5, 6]), 8, seed=6)
    assert "already failed" in str(exc.value)
    assert decode.kv.arrays()[0][[1, 2]].sum() == 0
    # Old page indices are refused outright; new ones work.
    with pytest.raises(errors.StaleMemoryVersion):
        decode.expect(12, boot, np.array([1]), decode.alloc_slot(), memory_version=1)
    decode.expect(13, boot, np.array([1, 2]), decode.alloc_slot())
    _fill_room(prefill, 13, np.array([5, 6]), 8, seed=7)
    assert decode.wait(13).state is RoomState.SUCCESS


def heard_of(client, room: int) -> bool:
    """Whether ``client``'s daemon knows ``room`` (one it never heard of is an error)."""
    try:
        client.poll(room)
    except errors.PdxferError:
        return False
    return True


def test_abort_on_either_side_fails_both_and_fences(engines):
    prefill = engines(engines.prefill_daemon, small_layout())
    decode = engines(engines.decode_daemon, small_layout())
    boot = engines.prefill_daemon.bootstrap
    slot = decode.alloc_slot()
    decode.expect(20, boot, np.array([1]), slot)
    decode.abort(20, "client went away")
    status = decode.wait(20)
    assert status.state is RoomState.FAILED and status.code == "aborted" and status.fenced
    assert "client went away" in status.reason
    # The prefill learns it once the decode daemon's link is up (a handshake of two
    # round trips, which the decode's room does not wait for: it was never requested),
    # and its send() is then refused with the reason.
    wait_until(lambda: heard_of(prefill, 20), 10, "the prefill to hear of the abort")
    with pytest.raises(errors.PdxferError, match="client went away"):
        _fill_room(prefill, 20, np.array([5]), 4, seed=8)
    decode.release(20)
    # Prefill-side abort.
    decode.expect(21, boot, np.array([2]), decode.alloc_slot())
    prefill.abort(21, "prefill preempted")
    dstat = decode.wait(21)
    assert dstat.state is RoomState.FAILED and "prefill preempted" in dstat.reason and dstat.fenced
