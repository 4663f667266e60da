"""Operator commands that read a running daemon through its admin API.

    pdxfer rooms [--state S] [--peer P] [--older-than T]   rooms, oldest first
    pdxfer room ID [--fail]                                one room and its history; fail it
    pdxfer peers / pdxfer peer P [--drain]                 the peer table; drain a peer
    pdxfer slots [--free]                                  the aux slot table
    (rooms, peers and slots take --all: every daemon in the runtime directory, one table)
    pdxfer top                                             a live view (top.py)

Each prints an aligned table, or with --json the reply's data. A daemon is chosen
by --daemon ENDPOINT, by --name NAME in --runtime-dir, or as the only admin socket
in the runtime directory. Requests are signed like bootstrap messages when a
cluster secret is given (--secret-file or PDXFER_CLUSTER_SECRET_FILE), which a
daemon started with --cluster-secret-file requires.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import secrets
import socket
import sys
from typing import Any, Callable

import msgspec
import zmq

from ..core.config import default_runtime_dir
from ..core.errors import BadMessage, PdxferError, Unauthenticated
from ..core.protocol import (
    AdminInfo,
    AdminPeers,
    AdminRoom,
    AdminRooms,
    AdminSlots,
    Codec,
    Error,
    InfoReply,
    Message,
    PeerInfo,
    RoomInfo,
    RoomState,
    SlotInfo,
)
from ..wire.seal import Seal, read_secret
from . import tables

EXIT_REFUSED = 1  # the daemon answered with an error: unknown room, read-only admin API, ...
EXIT_UNREACHABLE = 3  # no daemon could be chosen, or none answered
SECRET_ENV = "PDXFER_CLUSTER_SECRET_FILE"
RUNTIME_DIR_ENV = "PDXFER_RUNTIME_DIR"


class CommandError(Exception):
    """What to tell the operator, and the exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_UNREACHABLE) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class AdminClient:
    """A synchronous admin connection to one daemon: one request, one reply."""

    def __init__(self, endpoint: str, secret: bytes = b"", timeout: float = 5.0) -> None:
        self.endpoint = endpoint
        self.secret = secret
        self.timeout = timeout
        self.codec = Codec()
        self.seal = Seal(f"cli-{secrets.token_hex(6)}", secret)
        self._req = itertools.count(1)
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None

    def connect(self) -> "AdminClient":
        if self.endpoint.startswith("ipc://"):
            check_ipc(self.endpoint[len("ipc://") :])
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)
        return self

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._ctx.term()
            self._sock = self._ctx = None

    def __enter__(self) -> "AdminClient":
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, kind: type[Message], **fields: Any) -> Message:
        """Send one admin request; return its reply, or raise CommandError."""
        req = next(self._req)
        self._sock.send_multipart(self.seal.seal([self.codec.encode(kind(req=req, **fields))]))
        while True:
            if not self._sock.poll(int(self.timeout * 1000)):
                raise CommandError(
                    f"no answer from {self.endpoint} within {self.timeout:g}s: is a pdxfer daemon serving its admin API there? "
                    "(--timeout waits longer)"
                )
            # Anything else answers an earlier, timed-out request.
            mine = [reply for reply in self._open(self._sock.recv_multipart()) if reply.req in (req, 0)]
            if mine:
                reply = mine[0]
                break
        if isinstance(reply, Error):
            hint = ""
            if reply.code.value == "unauthenticated":
                hint = f" (the daemon runs with --cluster-secret-file: pass the same file with --secret-file or {SECRET_ENV})"
            raise CommandError(f"{self.endpoint} refused [{reply.code.value}]: {reply.message}{hint}", EXIT_REFUSED)
        return reply

    def _open(self, frames: list[bytes]) -> list[Message]:
        try:
            _, payloads = self.seal.open(frames)
            return [self.codec.admin_replies.decode(payload) for payload in payloads]
        except Unauthenticated:
            raise CommandError(f"the reply from {self.endpoint} is not signed with the secret in the given secret file: another cluster's daemon?", EXIT_REFUSED) from None
        except (BadMessage, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CommandError(f"{self.endpoint} answered something that is not a pdxfer admin reply: {exc}", EXIT_REFUSED) from None


def daemon_counters(endpoint: str, timeout: float = 5.0) -> dict[str, float]:
    """A daemon's own counters (blocks_submitted, bytes_moved, ...), from its admin API at ``endpoint``."""
    with AdminClient(endpoint, timeout=timeout) as admin:
        return dict(admin.call(AdminInfo).counters)


def check_ipc(path: str) -> None:
    """Fail fast, saying why, when an ipc socket is missing or nobody listens on it
    (a daemon that exited leaves its socket file behind), instead of waiting out the timeout."""
    if not os.path.exists(path):
        raise CommandError(f"no daemon socket at {path}: is the daemon running, with this --runtime-dir and --name?")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        raise CommandError(f"nothing listens on {path}: the daemon that created it has exited (it is removed when a daemon starts under that name)") from None
    except OSError:
        pass  # permissions and the like: let the request say what happens
    finally:
        probe.close()


# --- choosing a daemon


def runtime_dir(given: str | None) -> str:
    return given or os.environ.get(RUNTIME_DIR_ENV) or default_runtime_dir(os.environ)


def admin_sockets(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(directory), "*.admin.sock")))


def daemon_name(path: str) -> str:
    return os.path.basename(path)[: -len(".admin.sock")]


def choose_endpoint(daemon: str | None, name: str | None, directory: str) -> str:
    """--daemon ENDPOINT, else --name NAME in the runtime dir, else its only admin socket."""
    if daemon:
        if daemon.startswith(("ipc://", "tcp://")):
            return daemon
        host, sep, port = daemon.rpartition(":")
        if sep and host and port.isdigit():
            return f"tcp://{daemon}"
        raise CommandError(f"--daemon {daemon!r} is not an endpoint: use ipc:///path/NAME.admin.sock or tcp://host:port", 2)
    if name:
        return f"ipc://{os.path.join(directory, name)}.admin.sock"
    found = admin_sockets(directory)
    if len(found) == 1:
        return f"ipc://{found[0]}"
    if not found:
        raise CommandError(
            f"no daemon admin socket in {directory}: start a daemon (pdxfer serve), or point at one with "
            "--daemon ENDPOINT, or --name NAME with --runtime-dir DIR"
        )
    names = ", ".join(daemon_name(p) for p in found)
    raise CommandError(f"{len(found)} daemons in {directory} ({names}): choose one with --name NAME or --daemon ENDPOINT "
                       "(rooms, peers and slots: --all shows every one)", 2)


def command_secret(path: str | None) -> bytes:
    """The secret a command signs its requests with: the file ``path`` (--secret-file),
    else $PDXFER_CLUSTER_SECRET_FILE's, read as the daemon reads it; b"" for neither."""
    try:
        return read_secret(path or os.environ.get(SECRET_ENV, ""))
    except PdxferError as exc:
        raise CommandError(exc.message, 2) from None


def connect(args) -> AdminClient:
    endpoint = choose_endpoint(args.daemon, args.name, runtime_dir(args.runtime_dir))
    return AdminClient(endpoint, command_secret(args.secret_file), args.timeout).connect()


def run(args, body: Callable[[Any, AdminClient], int]) -> int:
    """Connect, run ``body``, and turn a CommandError into a message and an exit code."""
    try:
        admin = connect(args)
        try:
            return body(args, admin)
        finally:
            admin.close()
    except CommandError as exc:
        print(f"pdxfer {args.command}: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def every_daemon(args) -> list[tuple[str, str]]:
    """--all: (name, admin endpoint) of each daemon in the runtime directory."""
    if args.daemon or args.name:
        raise CommandError("--all reads every daemon in the runtime directory: leave out --daemon and --name", 2)
    directory = runtime_dir(args.runtime_dir)
    found = admin_sockets(directory)
    if not found:
        raise CommandError(f"no daemon admin socket in {directory}: start a daemon (pdxfer serve), or give --runtime-dir DIR")
    return [(daemon_name(path), f"ipc://{path}") for path in found]


def run_all(args, ask: Callable[[AdminClient], Any], show: Callable[[Any, list[tuple[str, Any]]], None]) -> int:
    """--all: ``ask`` each daemon in the runtime directory, then ``show`` the (name, answer)
    pairs together. A daemon that does not answer is reported and left out; the exit code
    then says so."""
    try:
        targets = every_daemon(args)
        secret = command_secret(args.secret_file)
    except CommandError as exc:
        print(f"pdxfer {args.command}: {exc.message}", file=sys.stderr)
        return exc.exit_code
    answers, exit_code = [], 0
    for name, endpoint in targets:
        try:
            with AdminClient(endpoint, secret, args.timeout) as admin:
                answers.append((name, ask(admin)))
        except CommandError as exc:
            print(f"pdxfer {args.command}: daemon {name}: {exc.message}", file=sys.stderr)
            exit_code = exit_code or exc.exit_code
        except KeyboardInterrupt:
            return 130
    show(args, answers)
    return exit_code


def by_daemon(columns: tuple[str, ...], answers: list[tuple[str, list[tuple]]], right: tuple[str, ...]) -> str:
    """One table of every daemon's rows, a DAEMON column first."""
    return tables.table(("DAEMON", *columns), [(name, *row) for name, rows in answers for row in rows], right=right)


def plain(struct: msgspec.Struct) -> dict:
    """Every field of a reply struct as JSON-ready builtins, defaults included."""
    return {name: msgspec.to_builtins(getattr(struct, name)) for name in struct.__struct_fields__}


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


# --- rooms and one room


ROOM_COLUMNS = ("ROOM", "ROLE", "STATE", "AGE", "IN STATE", "PEER", "SLOT/GEN", "PLANNED", "MOVED", "ERROR")
LANE = "LANE"  # after the first column, where a daemon serves several engine ranks (lanes)


def with_lanes(columns: tuple[str, ...], items: list[RoomInfo] | list[SlotInfo]) -> tuple[str, ...]:
    """``columns``, with LANE after the first where any room or slot is on a lane other
    than 0: a daemon serving several engine ranks holds a room (and a slot index) once
    per rank. A daemon beside a single rank shows the table as ever."""
    return (columns[0], LANE, *columns[1:]) if any(item.lane for item in items) else columns


def lane_cells(rows: list[tuple], items: list[RoomInfo] | list[SlotInfo], lanes: bool) -> list[tuple]:
    return [(row[0], item.lane, *row[1:]) for row, item in zip(rows, items)] if lanes else rows


def slot_gen(room: RoomInfo) -> str:
    return f"{room.slot}/{room.generation}" if room.slot >= 0 else "-"


def room_error(room: RoomInfo) -> str:
    """A failed room's error; a live one's note of what it waits for, if its daemon has one."""
    return f"[{room.code.value}] {room.reason}" if room.code else room.reason or "-"


ROOM_RIGHT = ("ROOM", LANE, "AGE", "IN STATE", "PLANNED", "MOVED")


def room_rows(rooms: list[RoomInfo], width: int = 72, lanes: bool = False) -> list[tuple]:
    rows = [
        (r.room, r.role.value, r.state.value, tables.duration(r.age), tables.duration(r.in_state), r.peer or "-", slot_gen(r),
         tables.size(r.bytes_planned), tables.size(r.bytes_moved), tables.shorten(room_error(r), width))
        for r in rooms
    ]
    return lane_cells(rows, rooms, lanes)


def rooms_table(rooms: list[RoomInfo], width: int = 72, indent: str = "") -> str:
    columns = with_lanes(ROOM_COLUMNS, rooms)
    return tables.table(columns, room_rows(rooms, width, LANE in columns), right=ROOM_RIGHT, indent=indent)


def rooms_summary(rooms: list[RoomInfo]) -> str:
    counts = {s.value: 0 for s in RoomState}
    for r in rooms:
        counts[r.state.value] += 1
    return f"{len(rooms)} rooms: " + ", ".join(f"{n} {state}" for state, n in counts.items() if n)


def cmd_rooms(args) -> int:
    state = RoomState(args.state) if args.state else None
    filtered = bool(state or args.peer or args.older_than)

    def ask(admin: AdminClient) -> list[RoomInfo]:
        return admin.call(AdminRooms, state=state, peer=args.peer or "", older_than=args.older_than).rooms

    def body(args, admin: AdminClient) -> int:
        rooms = ask(admin)
        if args.json:
            emit_json({"rooms": [plain(r) for r in rooms]})
        elif rooms:
            print(rooms_table(rooms))
            print(rooms_summary(rooms))
        else:
            print("no rooms" + (" match" if filtered else ""))
        return 0

    def show_all(args, answers: list[tuple[str, list[RoomInfo]]]) -> None:
        if args.json:
            emit_json({"rooms": [{"daemon": name, **plain(r)} for name, rooms in answers for r in rooms]})
            return
        if any(rooms for _, rooms in answers):
            columns = with_lanes(ROOM_COLUMNS, [r for _, rooms in answers for r in rooms])
            print(by_daemon(columns, [(name, room_rows(rooms, lanes=LANE in columns)) for name, rooms in answers], ROOM_RIGHT))
        for name, rooms in answers:
            print(f"{name}: " + (rooms_summary(rooms) if rooms else "no rooms" + (" match" if filtered else "")))

    return run_all(args, ask, show_all) if args.all else run(args, body)


def room_detail(room: RoomInfo, wall: float, lane: bool = False) -> str:
    """One room in full (``lane``: naming the engine rank's lane it is on); ``wall`` is
    the daemon's wall clock when it answered."""
    if room.released:
        return (f"room {room.room} ({room.role.value}{f', lane {room.lane}' if lane else ''}): released by its engine after it ended "
                f"{room.state.value}{'' if room.code is None else ': ' + room_error(room)}; the daemon keeps only that outcome")
    created = wall - room.age
    lines = [
        f"room {room.room} ({room.role.value}{f', lane {room.lane}' if lane else ''}): {room.state.value} for {tables.duration(room.in_state)}, "
        f"created {tables.duration(room.age)} ago ({tables.clock(created)})",
        f"  peer      {room.peer or '-'}",
        f"  slot      {room.slot if room.slot >= 0 else '-'}  generation {room.generation or '-'}",
        f"  bytes     planned {tables.size(room.bytes_planned)} ({room.bytes_planned}), moved {tables.size(room.bytes_moved)} ({room.bytes_moved})",
        f"  fenced    {'yes' if room.fenced else 'no'}",
        f"  error     {room_error(room)}",
        "",
        "history (time after creation; wall clock of the daemon):",
    ]
    rows = []
    for i, (state, at) in enumerate(room.history):
        until = room.history[i + 1][1] if i + 1 < len(room.history) else room.age
        rows.append((state.value, f"+{at:.3f}s", tables.clock(created + at), tables.duration(until - at) + ("" if i + 1 < len(room.history) else " (now)")))
    lines.append(tables.table(("STATE", "AT", "WALL CLOCK", "FOR"), rows, right=("AT", "FOR"), indent="  "))
    return "\n".join(lines)


def cmd_room(args) -> int:
    def body(args, admin: AdminClient) -> int:
        fields = {"room": args.room}
        if args.fail:
            fields.update(fail=True, reason=args.reason)
        rooms = admin.call(AdminRoom, **fields).rooms  # one part per engine rank (lane) that holds the room
        if args.json:
            emit_json(plain(rooms[0]) if len(rooms) == 1 else {"rooms": [plain(room) for room in rooms]})
            return 0
        info = admin.call(AdminInfo)
        if args.fail:
            print(f"room {args.room} failed by operator request on the {info.role.value} daemon {info.name!r}")
        print("\n\n".join(room_detail(room, info.wall, lane=len(rooms) > 1) for room in rooms))
        return 0

    return run(args, body)


# --- peers


PEER_COLUMNS = ("ADDRESS", "NAME", "INCARNATION", "STATE", "LAST HEARD", "RTT", "SKEW", "ROOMS", "FENCE-PENDING", "FENCED IN")


PEER_RIGHT = ("LAST HEARD", "RTT", "SKEW", "ROOMS", "FENCE-PENDING", "FENCED IN")


def peer_rows(peers: list[PeerInfo]) -> list[tuple]:
    return [
        (p.address, p.name or "-", p.incarnation or "-", p.state, tables.ago(p.last_heard), tables.millis(p.rtt_ms, unknown=-1.0),
         tables.millis(p.clock_skew_ms), p.rooms, p.fence_pending, tables.duration(p.fence_in))
        for p in peers
    ]


def peers_table(peers: list[PeerInfo], indent: str = "") -> str:
    return tables.table(PEER_COLUMNS, peer_rows(peers), right=PEER_RIGHT, indent=indent)


def show_peers(args, peers: list[PeerInfo], info: InfoReply | None) -> None:
    if args.json:
        emit_json({"peers": [plain(p) for p in peers]})
        return
    if info is not None:
        side = "prefill links (bootstrap endpoints)" if info.role.value == "decode" else "decode daemons (transfer sessions)"
        print(f"{info.role.value} daemon {info.name!r}: {len(peers)} peer(s), {side}")
    print(peers_table(peers) if peers else "no peers")


def cmd_peers(args) -> int:
    def body(args, admin: AdminClient) -> int:
        reply = admin.call(AdminPeers)
        show_peers(args, reply.peers, None if args.json else admin.call(AdminInfo))
        return 0

    def show_all(args, answers: list[tuple[str, list[PeerInfo]]]) -> None:
        if args.json:
            emit_json({"peers": [{"daemon": name, **plain(p)} for name, peers in answers for p in peers]})
        elif any(peers for _, peers in answers):
            print(by_daemon(PEER_COLUMNS, [(name, peer_rows(peers)) for name, peers in answers], PEER_RIGHT))
        else:
            print(f"no peers ({len(answers)} daemons)")

    return run_all(args, lambda admin: admin.call(AdminPeers).peers, show_all) if args.all else run(args, body)


CUT_TIMEOUT = 120.0  # a cut is answered once the old sessions ended: live prefills drain them first, within the fence bound


def cmd_peer(args) -> int:
    def body(args, admin: AdminClient) -> int:
        if args.cut:
            admin.timeout = max(admin.timeout, CUT_TIMEOUT)
        reply = admin.call(AdminPeers, drain=args.peer if args.drain else "", cut=args.peer if args.cut else "")
        matched = [p for p in reply.peers if args.peer in p.address or args.peer in p.name]
        if not matched:
            raise CommandError(f"no peer matches {args.peer!r} (known: {', '.join(p.address for p in reply.peers) or 'none'})", EXIT_REFUSED)
        if args.drain and not args.json:
            print(f"draining {len(matched)} peer(s): no new rooms with them; their {sum(p.rooms for p in matched)} room(s) finish")
        if args.cut and not args.json:
            print(f"cut: transfer sessions replaced; {reply.fenced} fence-pending room(s) fenced, their pages free for reuse")
        show_peers(args, matched, None)
        return 0

    return run(args, body)


# --- slots


SLOT_COLUMNS = ("SLOT", "STATE", "ROOM", "GEN", "SINCE", "FENCE IN")
HELD = ("granted", "armed", "written")


def slots_summary(slots: list[SlotInfo]) -> str:
    count = {state: sum(1 for s in slots if s.state == state) for state in ("free", *HELD, "quarantined")}
    held = sum(count[s] for s in HELD)
    detail = ", ".join(f"{s} {count[s]}" for s in HELD)
    return f"{len(slots)} slots: {count['free']} free, {held} held ({detail}), {count['quarantined']} quarantined"


SLOT_RIGHT = ("SLOT", LANE, "ROOM", "GEN", "SINCE", "FENCE IN")


def slot_rows(slots: list[SlotInfo], lanes: bool = False) -> list[tuple]:
    rows = [
        (s.index, s.state, s.room or "-", s.generation or "-", tables.duration(s.since),
         ("pending" if s.fence_in < 0 else tables.duration(s.fence_in)) if s.state == "quarantined" else "-")
        for s in slots
    ]
    return lane_cells(rows, slots, lanes)


def slots_table(slots: list[SlotInfo]) -> str:
    columns = with_lanes(SLOT_COLUMNS, slots)
    return tables.table(columns, slot_rows(slots, LANE in columns), right=SLOT_RIGHT)


def cmd_slots(args) -> int:
    def listed(slots: list[SlotInfo]) -> list[SlotInfo]:
        if args.state:
            return [s for s in slots if s.state == args.state]
        return slots if args.free else [s for s in slots if s.state != "free"]

    hint = "" if args.state or args.free else " (free slots not listed; --free lists them)"

    def body(args, admin: AdminClient) -> int:
        slots = admin.call(AdminSlots).slots
        if args.json:
            emit_json({"slots": [plain(s) for s in (listed(slots) if args.state else slots)]})
            return 0
        if not slots:
            print("no aux buffer registered yet: no slots")
            return 0
        if listed(slots):
            print(slots_table(listed(slots)))
        print(slots_summary(slots) + hint)
        return 0

    def show_all(args, answers: list[tuple[str, list[SlotInfo]]]) -> None:
        if args.json:
            emit_json({"slots": [{"daemon": name, **plain(s)} for name, slots in answers for s in (listed(slots) if args.state else slots)]})
            return
        if any(listed(slots) for _, slots in answers):
            columns = with_lanes(SLOT_COLUMNS, [s for _, slots in answers for s in listed(slots)])
            print(by_daemon(columns, [(name, slot_rows(listed(slots), LANE in columns)) for name, slots in answers], SLOT_RIGHT))
        for name, slots in answers:
            print(f"{name}: " + (slots_summary(slots) if slots else "no aux buffer registered yet: no slots"))
        if hint:
            print(hint.strip(" ()"))

    return run_all(args, lambda admin: admin.call(AdminSlots).slots, show_all) if args.all else run(args, body)
