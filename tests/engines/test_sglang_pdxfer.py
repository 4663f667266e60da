"""pdxfer as SGLang's transfer backend, on real engines (issue 28, docs/engines.md §B7): a
prefill ``sgl.Engine`` and a decode ``sgl.Engine`` in processes of their own, each beside
a pdxfer daemon, against one plain engine given the same prompts; and the same script
over SGLang's own Mooncake backend, so a failure here is pdxfer's, not the harness's.

Pass means token for token: every request's decode tokens equal the plain engine's. The
model's tokens depend on the whole prompt (model.py; `prompt_dependence`), so KV that
arrived wrong, late or not at all shows in them; the decode daemon runs ``--verify-kv``
besides, so a page that differs fails its room outright."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from pdxfer.core.protocol import AdminInfo, AdminRooms, AdminSlots, InfoReply
from pdxfer.ops.inspection import AdminClient
from pdxfer.tools.launch import start_daemon, stop_all
from tests.engines import sglang_pd
from tests.engines.conftest import ENGINE_TEST_TIMEOUT
from tests.engines.procs import WorkerError
from tests.engines.prompts import SAME_LAST_ID, Request, prompt_dependence
from tests.engines.test_sglang_baseline import mismatches

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

NUM_REQUESTS = 24


def acceptance_waves(seed: int = 28) -> list[list[Request]]:
    """24 requests in two waves, each wave sent at once (its rooms overlap): prompts of
    3 to 394 ids, most longer than a chunked-prefill step (64) so the prefill sends in
    chunks, some not page-aligned, two ending in the same id; in the first wave six
    share a 112-id prefix; the second wave extends first-wave prompts, so the decode's
    radix cache holds a prefix of each and the prefill sends only the rest."""
    rng = random.Random(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 1024) for _ in range(n))

    shared = ids(112)
    lengths = [3, 16, 17, 40, 64, 65, 100, 128, 150, 200, 257, 300]
    first = [Request(ids(n), rng.randrange(4, 12)) for n in lengths]
    first += [Request(shared + ids(n), rng.randrange(4, 12)) for n in (1, 9, 16, 33, 70, 150)]
    first[2] = Request(first[2].input_ids[:-1] + (SAME_LAST_ID,), first[2].max_new_tokens)
    first[8] = Request(first[8].input_ids[:-1] + (SAME_LAST_ID,), first[8].max_new_tokens)
    second = [Request(first[i].input_ids + ids(n), rng.randrange(4, 12)) for i, n in ((7, 5), (9, 40), (10, 3), (17, 64))]
    second += [Request(shared + ids(n), 6) for n in (20, 90)]
    return [first, second]


@pytest.fixture(scope="module")
def waves24() -> list[list[Request]]:
    return acceptance_waves()


@pytest.fixture(scope="module")
def reference24(needs_sglang, model_dir, waves24, tmp_path_factory) -> list[list[list[int]]]:
    return sglang_pd.generate_single(model_dir, str(tmp_path_factory.mktemp("single24")), waves24)


def test_the_waves_make_the_comparison_mean_something(reference24, waves24):
    """24 requests, chunked sends, and prompts ending alike that generate differently."""
    assert sum(map(len, waves24)) == NUM_REQUESTS
    assert sum(len(r.input_ids) > 4 * sglang_pd.CHUNKED_PREFILL_SIZE for w in waves24 for r in w) >= 3
    pairs = prompt_dependence(waves24, reference24)
    assert pairs and all(ta != tb for _, ta, _, tb in pairs)


def test_b7_mooncake_baseline_on_the_same_waves(needs_sglang, model_dir, waves24, reference24, tmp_path):
    run = sglang_pd.generate_pd(model_dir, str(tmp_path), waves24, backend="mooncake")
    assert mismatches(waves24, reference24, run.tokens) == []


def test_b7_pdxfer_pair_matches_single_engine(needs_sglang, model_dir, waves24, reference24, tmp_path):
    pair = sglang_pd.generate_pdxfer(model_dir, str(tmp_path), waves24)
    run, sent, received = pair.run, pair.sent, pair.received
    assert pair.exit_codes == [0, 0]

    assert mismatches(waves24, reference24, run.tokens) == []
    assert {kv["manager"] for kv in run.kvargs.values()} == {"PdxferKVManager"}
    # Every room succeeded on both daemons; --verify-kv fails a room whose KV differs.
    assert (received["rooms_succeeded"], received["rooms_failed"]) == (NUM_REQUESTS, 0)
    assert (sent["rooms_succeeded"], sent["rooms_failed"]) == (NUM_REQUESTS, 0)

    # What the schedulers asked of the backend: chunked sends, and a prefix the prefill
    # learnt from the pushed status and did not send.
    prefixes, chunked, pages_sent = [], 0, 0
    for wave, rooms in zip(waves24, run.rooms):
        for req, room in zip(wave, rooms):
            (prefix,) = [c["prefix_len"] for c in run.calls_for(room, "pop_decode_prefix_len")]
            sends = run.calls_for(room, "send")
            assert sum(s["num_kv_tokens"] for s in sends) == len(req.input_ids) - prefix, room
            prefixes.append(prefix)
            chunked += len(sends) > 1
            pages_sent += sum(s["pages"] for s in sends)
    assert chunked >= 8
    assert prefixes[:18] == [0] * 18 and all(p > 0 and p % sglang_pd.PAGE_SIZE == 0 for p in prefixes[18:]), prefixes
    # The decode daemon received exactly those pages (each one page of all four K/V
    # buffers), and an aux record per room: a 32-byte stamp and the ten metadata rows.
    kv = run.kvargs["decode-0.json"]
    assert received["bytes_received"] == pages_sent * sum(kv["kv_item_lens"]) + NUM_REQUESTS * (32 + sum(kv["aux_item_lens"]))


def admin_info(endpoint: str) -> InfoReply:
    with AdminClient(endpoint) as admin:
        return admin.call(AdminInfo)


def fault_waves(seed: int = 280) -> list[list[Request]]:
    """Four waves of four requests, prompts past a chunked-prefill step among them."""
    rng = random.Random(seed)
    return [[Request(tuple(rng.randrange(3, 1024) for _ in range(n)), 6) for n in (20, 70, 130, 200)] for _ in range(4)]


def test_a_killed_prefill_daemon_fails_requests_and_a_restarted_one_serves_again(needs_sglang, model_dir, tmp_path):
    """Wave 0 runs; the prefill daemon is killed (SIGKILL) before wave 1, whose requests
    fail on both servers naming pdxfer's reason instead of hanging; the daemon restarts
    on the same bootstrap port before wave 2, and the prefill server, connecting again
    with the same memory, serves wave 3 token for token (A10).

    Wave 2 is the first the decode daemon asks of the restarted process: it still takes
    the link for the old process's and, hearing the new one, fails those rooms as the
    old process's ("restarted"); a known limit of the daemon, not of the backend, so
    wave 2 may fail so, and only so."""
    waves = fault_waves()
    expected = sglang_pd.generate_single(model_dir, str(tmp_path / "single"), waves)
    runtime = tmp_path / "pdxfer"
    runtime.mkdir(mode=0o700)
    port = str(sglang_pd.free_port())
    daemons = {
        "prefill": start_daemon("prefill", str(runtime), "--bootstrap-port", port, stderr=open(tmp_path / "prefill-0.log", "w")),
        "decode": start_daemon("decode", str(runtime), "--verify-kv", stderr=open(tmp_path / "decode-daemon.log", "w")),
    }
    started = {}

    def between(wave: int) -> None:
        started[wave] = time.monotonic()
        if wave == 1:
            daemons["prefill"].proc.kill()
            daemons["prefill"].proc.wait()
        elif wave == 2:
            daemons["prefill"] = start_daemon("prefill", str(runtime), "--bootstrap-port", port, stderr=open(tmp_path / "prefill-1.log", "w"))

    try:
        run = sglang_pd.generate_pd(
            model_dir, str(tmp_path / "pd"), waves, backend="pdxfer", extra_plugins={"pdxfer": sglang_pd.entry_point()},
            prefill_env={"PDXFER_ENDPOINT": daemons["prefill"].engine}, decode_env={"PDXFER_ENDPOINT": daemons["decode"].engine},
            before_wave=between, op="generate_each",
        )
    finally:
        stop_all(list(daemons.values()))

    assert mismatches(waves[:1], expected[:1], run.tokens[:1]) == []
    for out in (*run.prefill_outputs[1], *run.decode_outputs[1]):
        assert "error" in out, out
    reasons = [o["error"] for o in run.prefill_outputs[1]]
    assert all("pdxfer [peer_unreachable]" in r and "went away" in r for r in reasons), reasons
    # The decode daemon declared the prefill dead (heartbeats) and failed the rooms,
    # unfenced: the requests fail now, their pages held until the restart fences them.
    reasons = [o["error"] for o in run.decode_outputs[1]]
    assert all("pdxfer [peer_dead]" in r for r in reasons), reasons
    print(f"wave 1 (prefill daemon killed) ended in {started[2] - started[1]:.1f} s")
    for want, out in zip(expected[2], run.decode_outputs[2]):
        assert out.get("output_ids") == want or "restarted (incarnation" in out.get("error", ""), out
    assert mismatches(waves[3:], expected[3:], run.tokens[3:]) == []


class RoomWatch:
    """Polls daemons' admin APIs while engines work, a thread per daemon (one that
    stands still holds up only its own): every distinct (state, fenced, code) each
    daemon reported for each room, in order, and the states of the aux slot bound to
    it. A room's entry goes when its engine releases it, so this is taken as it happens."""

    def __init__(self, admins: dict[str, str], period: float = 0.01) -> None:
        self.period = period
        self.seen: dict[tuple[str, int], list[tuple]] = {}
        self.slots: dict[tuple[str, int], list[str]] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=item, daemon=True) for item in admins.items()]

    def __enter__(self) -> "RoomWatch":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    @staticmethod
    def _note(into: dict, key: tuple, value) -> None:
        seen = into.setdefault(key, [])
        if not seen or seen[-1] != value:
            seen.append(value)

    def _run(self, name: str, admin: str) -> None:
        with AdminClient(admin) as client:
            while not self._stop.is_set():
                for r in client.call(AdminRooms).rooms:
                    self._note(self.seen, (name, r.room), (r.state.value, r.fenced, r.code.value if r.code else None))
                for s in client.call(AdminSlots).slots:
                    if s.room:
                        self._note(self.slots, (name, s.room), s.state)
                self._stop.wait(self.period)


def abort_waves(seed: int = 281) -> list[list[Request]]:
    """Four waves of three requests; each wave's first has a 960-id prompt (15
    chunked-prefill steps, 60 pages), the one a fault test aborts: its room transfers
    for as long as the prefill computes, long enough for a watcher on a loaded host to
    see it (at 600 ids one was over in 150 ms, unseen)."""
    rng = random.Random(seed)
    return [[Request(tuple(rng.randrange(3, 1024) for _ in range(n)), 6) for n in (960, 100, 250)] for _ in range(4)]


def test_an_aborted_request_ends_aborted_on_both_sides_and_its_decode_pages_wait_for_the_fence(needs_sglang, model_dir, tmp_path):
    """A request aborted mid-transfer (the prefill daemon writing its room), once by the
    decode server's client (wave 1) and once by the prefill server's (wave 2), as a
    client that goes away does: both servers end it aborted, neither hangs nor answers
    tokens; both daemons fail its room as aborted; the decode holds its pages (SGLang's
    deferred release) until pdxfer fenced the room, and only then gives them back; the
    requests beside it and the next wave match the plain engine token for token.

    In wave 1 the prefill daemon is stopped (SIGSTOP) for 2 s as the decode aborts: it
    cannot confirm that nothing is in flight before it resumes, so the decode daemon
    holds the room failed and unfenced, and SGLang holds the pages, long enough to see."""
    waves = abort_waves()
    expected = sglang_pd.generate_single(model_dir, str(tmp_path / "single"), waves)
    runtime = tmp_path / "pdxfer"
    runtime.mkdir(mode=0o700)
    prefill = start_daemon("prefill", str(runtime), stderr=open(tmp_path / "prefill-daemon.log", "w"))
    decode = start_daemon("decode", str(runtime), "--verify-kv", stderr=open(tmp_path / "decode-daemon.log", "w"))
    when = {"index": 0, "admin": prefill.ready["admin"], "state": "transferring"}
    paused = {**when, "pause": {"pid": prefill.proc.pid, "seconds": 2.0}}

    def wave_args(wave: int) -> tuple[dict, dict]:
        return ({"abort": when} if wave == 2 else {}), ({"abort": paused} if wave == 1 else {})

    try:
        with RoomWatch({"decode": decode.ready["admin"]}) as watch:
            run = sglang_pd.generate_pd(
                model_dir, str(tmp_path / "pd"), waves, backend="pdxfer", extra_plugins={"pdxfer": sglang_pd.entry_point()},
                plugins=(*sglang_pd.BASELINE_PLUGINS, "decode_log"),
                prefill_env={"PDXFER_ENDPOINT": prefill.engine}, decode_env={"PDXFER_ENDPOINT": decode.engine},
                op="generate_each", wave_args=wave_args,
            )
        infos = {name: admin_info(d.ready["admin"]) for name, d in (("prefill", prefill), ("decode", decode))}
    finally:
        assert stop_all([decode, prefill]) == [0, 0]

    aborted = {1: run.rooms[1][0], 2: run.rooms[2][0]}
    by_decode, by_prefill = run.decode_outputs[1][0], run.prefill_outputs[2][0]
    # Aborted mid-transfer: the prefill daemon was writing the room and had moved less
    # than its KV (its bytes planned grow chunk by chunk).
    room_kv = -(-len(waves[1][0].input_ids) // sglang_pd.PAGE_SIZE) * sum(run.kvargs["decode-0.json"]["kv_item_lens"])
    for out in (by_decode, by_prefill):
        at = out["aborted_at"]
        assert at["state"] == "transferring" and at["bytes_moved"] < room_kv, (at, room_kv)
    # Both servers end both requests aborted: the side the client left says so, the
    # other fails it with pdxfer's reason; no tokens.
    for out in (by_decode, by_prefill):
        assert "abort" in str(out).lower() and not out.get("output_ids"), out
    assert "pdxfer [aborted]" in run.prefill_outputs[1][0].get("error", ""), run.prefill_outputs[1][0]
    assert "pdxfer [aborted]" in run.decode_outputs[2][0].get("error", ""), run.decode_outputs[2][0]
    # Everything else, the aborted requests' neighbours and the last wave, token for token.
    for w in range(4):
        kept = [i for i in range(3) if w not in aborted or i != 0]
        assert [run.tokens[w][i] for i in kept] == [expected[w][i] for i in kept], w
    for name, info in infos.items():
        assert (info.counters["rooms_succeeded"], info.counters["rooms_failed"]) == (10, 2), (name, info.counters)
        assert info.failures == {"aborted": 2}, (name, info.failures)

    held = {}
    for wave, room in aborted.items():
        # SGLang held the pages, and gave them back once pdxfer said the room was fenced.
        (hold,) = run.calls_for(room, "hold")
        (release,) = run.calls_for(room, "release_pages")
        assert release["safe"] is True and release["t"] >= hold["t"], (hold, release)
        held[wave] = release["t"] - hold["t"]
    # Wave 1: while the prefill daemon could not answer, the decode daemon held the room
    # failed (aborted) and unfenced, its aux slot quarantined, and SGLang its pages: they
    # went back only after the prefill resumed and confirmed. (A room fenced at once, as
    # wave 2's, lives for milliseconds after it fails: the daemons' counters stand for it.)
    states, slots = watch.seen[("decode", aborted[1])], watch.slots[("decode", aborted[1])]
    assert ("failed", False, "aborted") in states and "quarantined" in slots, (states, slots)
    (release,) = run.calls_for(aborted[1], "release_pages")
    assert release["t"] > by_decode["aborted_at"]["resumed"], (release, by_decode["aborted_at"])
    # No other room's pages went back through a failure path.
    assert sorted(c["room"] for c in run.calls if c["call"] == "release_pages") == sorted(aborted.values())
    print("decode pages held until fenced: " + ", ".join(f"wave {w} {s:.2f} s" for w, s in held.items()))



FREEZE_SECONDS = 40.0  # past SGLang's deferred release timeout (30 s by default)


def host_processes(daemon) -> list[int]:
    """Every process of a 'host': the SGLang server's processes beside ``daemon`` (their
    environment names its engine endpoint), the daemon, and its transfer engine's process."""
    wanted = f"PDXFER_ENDPOINT={daemon.engine}".encode()
    pids = {daemon.proc.pid, daemon.ready["engine_pid"]}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if wanted in fh.read().split(b"\0"):
                        pids.add(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return sorted(pids)


class HostFreeze:
    """Stops (SIGSTOP) every process of the prefill's host once its daemon reports a room
    transferring, as a paused VM would, and resumes them FREEZE_SECONDS later: on a thread,
    while the wave waits for its answers."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.frozen_at = self.resumed_at = 0.0  # wall clock
        self.pids: list[int] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        with AdminClient(self.daemon.ready["admin"]) as admin:
            deadline = time.monotonic() + 120
            while not any(r.state.value == "transferring" for r in admin.call(AdminRooms).rooms):
                assert time.monotonic() < deadline, "no room of the wave reached transferring"
                time.sleep(0.005)
        self.pids = host_processes(self.daemon)
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)
        self.frozen_at = time.time()
        time.sleep(FREEZE_SECONDS)
        for pid in reversed(self.pids):
            os.kill(pid, signal.SIGCONT)
        self.resumed_at = time.time()

    def join(self) -> None:
        self._thread.join(FREEZE_SECONDS + 180)


def test_a_prefill_host_frozen_past_sglangs_release_timeout_leaves_no_decode_request_with_wrong_kv(needs_sglang, model_dir, tmp_path):
    """The default settings on both sides (SGLang holds a failed request's decode pages
    for 30 s at most; the decode daemon fences within its 15 s bound). The prefill
    server's whole host (its SGLang processes, its daemon and that daemon's transfer
    engine process) stops for 40 s while wave 1 transfers. The decode daemon hears
    nothing, fails the rooms, ends its old transfer sessions and fences them; SGLang
    gives the pages back because pdxfer says they are safe, not because it gave up
    waiting. Every decode request of wave 1 ends with an error or the plain engine's
    tokens; wave 0 before and wave 2 after match token for token, the decode daemon
    checking every page's digest (--verify-kv)."""
    waves = abort_waves(seed=43)[:3]
    expected = sglang_pd.generate_single(model_dir, str(tmp_path / "single"), waves)
    runtime = tmp_path / "pdxfer"
    runtime.mkdir(mode=0o700)
    prefill = start_daemon("prefill", str(runtime), stderr=open(tmp_path / "prefill-daemon.log", "w"))
    decode = start_daemon("decode", str(runtime), "--verify-kv", stderr=open(tmp_path / "decode-daemon.log", "w"))
    freeze = HostFreeze(prefill)

    def between(wave: int) -> None:
        if wave == 1:
            freeze.start()

    try:
        run = sglang_pd.generate_pd(
            model_dir, str(tmp_path / "pd"), waves, backend="pdxfer", extra_plugins={"pdxfer": sglang_pd.entry_point()},
            plugins=(*sglang_pd.BASELINE_PLUGINS, "decode_log"),
            prefill_env={"PDXFER_ENDPOINT": prefill.engine}, decode_env={"PDXFER_ENDPOINT": decode.engine},
            op="generate_each", before_wave=between,
        )
        freeze.join()
        info = admin_info(decode.ready["admin"])
    finally:
        assert stop_all([decode, prefill]) == [0, 0]

    assert len(freeze.pids) >= 4, freeze.pids  # the server's processes, the daemon, its transfer engine's
    assert mismatches(waves[:1], expected[:1], run.tokens[:1]) == []
    assert mismatches(waves[2:], expected[2:], run.tokens[2:]) == []
    failed = []
    for room, want, out in zip(run.rooms[1], expected[1], run.decode_outputs[1]):
        assert out.get("output_ids") == want or "error" in out, out
        if "error" in out:
            failed.append(room)
    assert failed, "the freeze failed no request: it caught nothing in flight"
    for room in failed:
        (release,) = run.calls_for(room, "release_pages")
        assert release["safe"] is True, release  # pdxfer fenced the room: SGLang did not give up on it
        assert release["t"] < freeze.resumed_at, (release, freeze.resumed_at)
        assert release["t"] - freeze.frozen_at < 30.0, (release, freeze.frozen_at)  # before SGLang's own timeout
    assert info.counters["session_rotations"] >= 1 and info.counters["rooms_fenced_by_session_end"] >= len(failed), info.counters
    print(f"{len(failed)} decode requests failed with the frozen host, their pages back "
          f"{max(c['t'] for r in failed for c in run.calls_for(r, 'release_pages')) - freeze.frozen_at:.1f} s into the freeze")


def test_a_decode_server_without_deferred_release_refuses_to_start(needs_sglang, model_dir, tmp_path):
    """With SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE off, SGLang frees an
    aborted request's decode pages at once, while the prefill daemon may still write
    them: a decode server on the pdxfer backend refuses to start, naming the variable."""
    env = sglang_pd.engine_env(str(tmp_path), (), {"pdxfer": sglang_pd.entry_point()},
                               {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "0"})
    decode = sglang_pd._worker("sglang-decode", str(tmp_path), model_dir, {
        "disaggregation_transfer_backend": "pdxfer", "disaggregation_mode": "decode",
        "disaggregation_decode_retraction_backup": "cpu_tensor"}, env)
    decode.start()
    try:
        with pytest.raises(WorkerError) as refused:
            decode.ready(sglang_pd.START_TIMEOUT)
    finally:
        decode.stop()
    assert "needs SGLang's deferred decode KV release" in str(refused.value), str(refused.value)[-3000:]


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_b7_tp_servers_of_different_sizes_match_single_engine(prefill_tp, decode_tp, needs_sglang, model_dir, waves24, reference24, tmp_path):
    """A server of two TP ranks (each one of the model's two KV heads, gloo between
    them) and a server of one, through one pdxfer daemon per side serving every rank.
    TP2 -> TP1: the decode daemon gathers each room from both prefill ranks, each
    writing its head into every token of the decode's pages (fan-in, docs/engines.md §G3);
    TP1 -> TP2: the prefill rank writes each decode rank its head (fan-out). The same
    waves as the TP1 pair, token for token against the plain TP1 engine."""
    sizes = {"prefill": prefill_tp, "decode": decode_tp}
    kwargs = {}
    for side, tp in sizes.items():
        if tp > 1:
            kwargs[f"{side}_args"], kwargs[f"{side}_env"] = sglang_pd.tensor_parallel(tp)
    # The decode daemon gathers its ranks' expects for the default 1 ms (A5): SGLang's
    # ranks expect a room milliseconds apart, so a late rank's legs may go to the
    # prefill in a request of their own.
    pair = sglang_pd.generate_pdxfer(model_dir, str(tmp_path), waves24, **kwargs)
    run, sent, received = pair.run, pair.sent, pair.received
    assert pair.exit_codes == [0, 0]

    assert mismatches(waves24, reference24, run.tokens) == []
    assert sorted(run.kvargs) == sorted(f"{side}-{r}.json" for side, tp in sizes.items() for r in range(tp))
    prefill_kv, decode_kv = run.kvargs["prefill-0.json"], run.kvargs["decode-0.json"]
    # A rank of a TP2 server holds one of the two heads: its pages are half as long.
    assert [n * prefill_tp for n in prefill_kv["kv_item_lens"]] == [n * decode_tp for n in decode_kv["kv_item_lens"]]
    # Every room succeeded on both daemons: on the decode's once per decode rank, on the
    # prefill's once per leg (a prefill rank keeps a room part per decode rank it writes).
    # --verify-kv checks whole pages only, and these legs are head slices: the tokens are
    # what proves the KV here.
    assert (received["rooms_succeeded"], received["rooms_failed"]) == (decode_tp * NUM_REQUESTS, 0)
    assert (sent["rooms_succeeded"], sent["rooms_failed"]) == (max(prefill_tp, decode_tp) * NUM_REQUESTS, 0)
    # SGLang's pages are token-major, so a head slice is a span per token: the side holding the slice staged it
    # (core/staging.py). TP2 -> TP1: every leg landed in the decode daemon's staging buffer; TP1 -> TP2: the
    # prefill daemon gathered the chunks. Every extent came back, and none was refused for lack of room.
    if prefill_tp > decode_tp:
        assert (received["legs_staged"], sent["chunks_gathered"]) == (prefill_tp * NUM_REQUESTS, 0)
    else:
        assert received["legs_staged"] == 0 and sent["chunks_gathered"] >= decode_tp * NUM_REQUESTS
    assert received["staging_full"] == sent["staging_full"] == 0
    assert received["staging_taken_bytes"] == sent["staging_taken_bytes"] == 0

    # Every prefill rank was handed the same chunks of every room; each decode rank
    # received those pages whole (its heads of every token of the four K/V buffers),
    # and its own aux record.
    pages_sent = 0
    for wave, rooms in zip(waves24, run.rooms):
        for req, room in zip(wave, rooms):
            by_rank = {}
            for s in run.calls_for(room, "send"):
                by_rank.setdefault(s["pid"], []).append((s["pages"], s["num_kv_tokens"]))
            assert len(by_rank) == prefill_tp and len(set(map(tuple, by_rank.values()))) == 1, (room, by_rank)
            (prefix,) = {c["prefix_len"] for c in run.calls_for(room, "pop_decode_prefix_len")}
            chunks = next(iter(by_rank.values()))
            assert sum(tokens for _, tokens in chunks) == len(req.input_ids) - prefix, room
            pages_sent += sum(pages for pages, _ in chunks)
    per_rank = pages_sent * sum(decode_kv["kv_item_lens"]) + NUM_REQUESTS * (32 + sum(decode_kv["aux_item_lens"]))
    assert received["bytes_received"] == decode_tp * per_rank
