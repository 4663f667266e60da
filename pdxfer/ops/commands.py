"""Flags of the operator commands (rooms, room, peers, peer, slots, top, doctor).
Standard library only, so ``pdxfer --help`` stays fast; inspection.py, top.py and
doctor.py are imported when a command runs."""

from __future__ import annotations

import argparse
import re

STATES = ("bootstrapping", "waiting_for_input", "transferring", "success", "failed")
SLOT_STATES = ("free", "granted", "armed", "written", "quarantined")

TARGET_HELP = """\
Which daemon: --daemon ENDPOINT (its admin endpoint, printed as "admin" in its ready
line), or --name NAME (its --name) in --runtime-dir, or, with neither, the only
daemon in the runtime directory (rooms, peers, slots: --all reads every one). Exit codes: 0 done, 1 the daemon refused (unknown
room, read-only admin API, ...), 2 bad arguments, 3 no daemon chosen or none answered."""


def seconds(text: str) -> float:
    """'90', '1.5s', '250ms', '2m', '1h' -> seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (examples: 30, 1.5s, 250ms, 2m, 1h)")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]


def int_between(low: int, high: int | None = None):
    """An argparse type: an integer from ``low`` to ``high`` (None: no limit). A value a
    daemon would refuse is refused here, before a command (the bench) has started anything."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r}: need at least {low}" if high is None else f"{text!r}: need {low} to {high}")
        return value

    return parse


positive_int = int_between(1)


def room_id(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        value = 0
    if not 1 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a room id (an integer from 1 to 2**64-1)")
    return value


def target_flags(json_help: str) -> argparse.ArgumentParser:
    """Flags every command that talks to a daemon shares."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("daemon")
    group.add_argument("--daemon", metavar="ENDPOINT",
                       help="the daemon's admin endpoint: ipc:///DIR/NAME.admin.sock or tcp://HOST:PORT (its --admin-endpoint)")
    group.add_argument("--name", metavar="NAME", help="the daemon's --name: its socket is ipc://RUNTIME_DIR/NAME.admin.sock")
    group.add_argument("--runtime-dir", metavar="DIR",
                       help="where the daemons' sockets are (default: $PDXFER_RUNTIME_DIR, else $XDG_RUNTIME_DIR/pdxfer, else /tmp/pdxfer-UID)")
    group.add_argument("--secret-file", metavar="FILE",
                       help="cluster secret to sign requests with, for daemons run with --cluster-secret-file "
                       "(default: $PDXFER_CLUSTER_SECRET_FILE)")
    group.add_argument("--timeout", type=seconds, default=5.0, metavar="SECONDS",
                       help="how long to wait for the daemon's answer (default: 5)")
    parent.add_argument("--json", action="store_true", help=json_help)
    return parent


def every_daemon_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--all", action="store_true",
                        help="every daemon in --runtime-dir, in one table with a DAEMON column (JSON: a \"daemon\" key on each entry)")


def _command(sub, name: str, help: str, description: str, json_help: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        name, help=help, description=description, epilog=TARGET_HELP, parents=[target_flags(json_help)],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the operator command ``args.command``. Its module is imported now, not when
    the parser is built, so that ``pdxfer --help`` stays fast."""
    if args.command == "top":
        from .top import cmd_top as command
    elif args.command == "doctor":
        from .doctor import cmd_doctor as command
    else:
        from .inspection import cmd_peer, cmd_peers, cmd_room, cmd_rooms, cmd_slots

        command = {"rooms": cmd_rooms, "room": cmd_room, "peers": cmd_peers, "peer": cmd_peer, "slots": cmd_slots}[args.command]
    return command(args)


def add_commands(sub) -> None:
    rooms = _command(
        sub, "rooms", "list the rooms a daemon holds: state, age, peer, slot, bytes, error",
        "List the rooms a daemon holds, oldest first: id, role, state, age, time in its state, peer, aux slot and\n"
        "generation, bytes planned and moved, and the error of a failed room. Released rooms are gone.",
        "print {\"rooms\": [...]}, every field of each room, instead of a table",
    )
    rooms.add_argument("--state", choices=STATES, help="only rooms in this state")
    rooms.add_argument("--peer", metavar="P", help="only rooms whose peer address contains P (e.g. a host or a port)")
    rooms.add_argument("--older-than", type=seconds, default=0.0, metavar="T",
                       help="only rooms created at least T ago (30, 1.5s, 250ms, 2m, 1h)")
    every_daemon_flag(rooms)

    room = _command(
        sub, "room", "show one room in full with its transition history; --fail fails it",
        "Show one room: state, peer, slot and generation, bytes, error, and each state it went through with\n"
        "the time after creation and the daemon's wall clock. With --fail, fail the room (its engine and its\n"
        "peer are told, its slot is quarantined until fenced); the daemon must run with --admin-writes.\n"
        "A daemon serving several ranks of an engine holds a room once per rank (lane): each part is shown,\n"
        "and --fail fails them all. A room its engine released is gone; the daemon keeps the outcome of the\n"
        "last --max-rooms of them, shown with \"released\" (JSON: released: true).",
        "print the room, every field and its history as [state, seconds after creation] pairs "
        "(several parts: {\"rooms\": [...]})",
    )
    room.add_argument("room", type=room_id, metavar="ID", help="the room id")
    room.add_argument("--fail", action="store_true", help="operator action: fail this live room (needs a daemon run with --admin-writes)")
    room.add_argument("--reason", default="no reason given", help="with --fail: why, recorded in the room's error (default: 'no reason given')")

    peers = _command(
        sub, "peers", "list a daemon's peers: address, incarnation, last heartbeat, RTT, rooms, state",
        "List a daemon's peers. On a decode daemon, one prefill link per bootstrap address (connecting until\n"
        "the prefill welcomed it, then alive); on a prefill daemon, each decode daemon that said hello, by\n"
        "its transfer session. RTT is measured by the decode side's heartbeats; clock skew is the peer's\n"
        "wall clock minus ours (one-way estimate on the prefill side).",
        "print {\"peers\": [...]}, every field of each peer",
    )
    every_daemon_flag(peers)

    peer = _command(
        sub, "peer", "show the peers matching P; --drain stops new rooms with them; --cut fences their rooms",
        "Show the peers whose address or name contains P. With --drain, stop new rooms with them (the rooms\n"
        "they hold finish); the daemon must run with --admin-writes. A drain lasts until the daemon restarts.\n"
        "With --cut (decode daemon, --admin-writes), fence now the rooms that are fence-pending because a\n"
        "prefill stopped answering (frozen, partitioned, or dead with no successor), which the decode daemon\n"
        "would otherwise do itself within its --fence-bound: it starts new transfer sessions, tells every\n"
        "prefill, ends the old ones once the prefills it still hears from drained them (or at a deadline),\n"
        "so nothing sent through them can land, and fences every fence-pending room (their engines may reuse\n"
        "the pages). A healthy prefill's rooms go on through the new sessions. Answered once that is done.",
        "print {\"peers\": [...]} of the matching peers",
    )
    peer.add_argument("peer", metavar="P", help="part of the peer's address or name, e.g. 10.0.0.5:18998")
    peer.add_argument("--drain", action="store_true", help="operator action: no new rooms with the matching peers (needs --admin-writes)")
    peer.add_argument("--cut", action="store_true", help="operator action on a decode daemon: end its transfer sessions now, not within --fence-bound, and fence every fence-pending room (needs --admin-writes)")

    slots = _command(
        sub, "slots", "show the aux slot table: free, held (granted/armed/written), quarantined",
        "Show the aux slot table: each slot's state (free; held: granted to the engine, armed for a room,\n"
        "written with a verified record; quarantined until its failed room is fenced), owner room,\n"
        "generation, time in that state, and for quarantined slots the time left to the fence deadline\n"
        "('pending' on a decode daemon: held until the prefill confirms, restarts, the fence bound passes,\n"
        "or `pdxfer peer P --cut`).",
        "print {\"slots\": [...]}, every slot (or those in --state)",
    )
    slots.add_argument("--state", choices=SLOT_STATES, help="only slots in this state")
    slots.add_argument("--free", action="store_true", help="list free slots too (the table omits them by default; --json never does)")
    every_daemon_flag(slots)

    top = _command(
        sub, "top", "a live view: rooms by state, throughput, queue depths, peers, oldest live rooms",
        "A live view of one daemon, redrawn in place while stdout is a terminal: rooms and slots by state,\n"
        "throughput from the daemon's counters between refreshes, totals, transfer queue depths, failures by\n"
        "reason, peers, and the oldest live rooms. The screen fits the terminal (tables show the rows that fit\n"
        "and count the rest). q or Ctrl-C quits.",
        "print one JSON object per refresh (info, rates, peers, live rooms) instead of a screen",
    )
    top.add_argument("--interval", type=seconds, default=1.0, metavar="SECONDS", help="seconds between refreshes (default: 1)")
    top.add_argument("--iterations", type=positive_int, default=0, metavar="N", help="stop after N refreshes (default: run until Ctrl-C)")
    top.add_argument("--once", action="store_true", help="one refresh, then exit (same as --iterations 1)")

    from .doctor import DESCRIPTION as DOCTOR_DESCRIPTION  # standard library only at import

    doctor = sub.add_parser(
        "doctor", help="check this host for what a daemon needs, and say how to fix each failure",
        description=DOCTOR_DESCRIPTION, epilog="Exit code: 1 if any check FAILs, else 0.",
        parents=[target_flags("print {\"ok\": ..., \"checks\": [{name, status, detail, fix}]} instead of text")],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--config", metavar="FILE", help="read options from this TOML file, like pdxfer serve (env: PDXFER_CONFIG)")
    doctor.add_argument("--role", choices=("prefill", "decode"), help="the daemon's role; decode daemons open no bootstrap port (default: $PDXFER_ROLE, else check both)")
    doctor.add_argument("--protocol", choices=("tcp", "rdma", "nvlink", "intranode_nvlink", "ascend", "hixl"),
                        help="transfer protocol the daemon will use (default: $PDXFER_PROTOCOL, else tcp)")
    doctor.add_argument("--device", metavar="DEV", help="cpu, cuda:N or npu:N, as for pdxfer serve (default: $PDXFER_DEVICE, else cpu)")
    doctor.add_argument("--host", metavar="ADDR", help="address the daemon binds (default: $PDXFER_HOST, else 127.0.0.1)")
    doctor.add_argument("--bootstrap-port", type=int, metavar="PORT", help="prefill bootstrap port to check is free (default: $PDXFER_BOOTSTRAP_PORT, else 18998)")
    doctor.add_argument("--http-port", type=int, metavar="PORT", help="metrics/health port to check is free; 0: off (default: $PDXFER_HTTP_PORT, else 0)")
    doctor.add_argument("--rdma-devices", metavar="LIST", help="rdma: the comma-separated device filter the daemon will use (default: $PDXFER_RDMA_DEVICES)")
    doctor.add_argument("--pool-bytes", type=_size, default=1 << 30, metavar="SIZE",
                        help="bytes of KV pool and aux buffer the engines on this host put in /dev/shm, e.g. 8GiB (default: 1GiB)")
    doctor.set_defaults(func=run)


def _size(text: str) -> int:
    """'1073741824', '512MiB', '8GiB', '2G' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 1073741824, 512MiB, 8GiB)")
    unit = (match.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(float(match.group(1)) * 1024 ** " KMGT".index(unit or " "))
