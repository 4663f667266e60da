"""``pdxfer soak``: minutes of rooms with every fault mixed in, to catch leaks and
rare corruptions the test suite is too short to see.

Each round runs the chaos engines (random aborts on both sides, stalls, 4 aux slots)
against a prefill daemon whose transport delays completions, replays late aux
writes into reused slots and fails a few writes. In the middle of each round one
daemon-level fault, in turn: the prefill daemon frozen (SIGSTOP) for up to 3.5 s,
sometimes past the heartbeat bound; the decode daemon killed (-9) and restarted
under a new incarnation; the prefill frozen longer than the decode side's lease and
fence timeout together, so that its rooms there must wait, fence-pending, for a proof:
its confirmation once it resumes, or the decode daemon ending the transfer sessions it
could write through (--fence-bound); a clock would have handed their pages back while
its transfer engine still held writes for them. Every round prints its rooms, failures by
reason, corruptions (must stay 0) and both daemons' resident memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter

from .chaos import ChaosSpec, run_chaos, settled_stats
from ..ops.inspection import AdminClient
from .launch import DaemonProcess, LaunchError, start_daemon
from ..core.protocol import AdminRooms

FAULTS = "delay=0.3:3,ghost=0.3:15,fail=0.002"
HEARTBEAT_BOUND = 2.0  # interval x misses below
LEASE_SPAN = 5.0 + 1.0  # transfer timeout + fence timeout below: when a timer would have fenced
TIMING = [
    "--heartbeat-interval", "0.5", "--heartbeat-misses", "4", "--fence-timeout", "1",
    "--transfer-timeout", "5", "--bootstrap-timeout", "5", "--waiting-timeout", "5",
    "--aux-path", "transfer_engine", "--log-level", "warning",
    # A chaos engine whose call timed out while its daemon was frozen gives up on its
    # rooms and releases none (chaos.py): the daemon drops them at the retention. Under
    # the 30 s the leak check waits, so what it finds held is a real leak.
    "--retention", "15",
]


def held_rooms(admin: str, most: int = 10) -> list[str]:
    """The first rooms a daemon still holds, each as a line: what a leak report needs."""
    with AdminClient(admin) as client:
        rooms = client.call(AdminRooms).rooms
    return [f"  room {r.room} {r.state.value} fenced={r.fenced} age {r.age:.1f}s peer={r.peer or '-'} [{r.code.value if r.code else ''}] {r.reason}"
            for r in rooms[:most]] + ([f"  ... and {len(rooms) - most} more"] if len(rooms) > most else [])


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.runtime = ""
        self.prefill: DaemonProcess | None = None
        self.decode: DaemonProcess | None = None
        self.logs: dict[str, object] = {}

    def _start(self, role: str) -> DaemonProcess:
        log = self.logs.setdefault(role, open(os.path.join(self.runtime, f"{role}.log"), "a"))
        flags = list(TIMING)
        if role == "prefill":
            flags += ["--inject-faults", f"{FAULTS},seed={self.rng.randrange(1 << 30)}"]
        return start_daemon(role, self.runtime, *flags, stderr=log)

    def _disturb(self, round_no: int) -> str:
        """A daemon-level fault, in the middle of a round (runs in a worker thread)."""
        what = round_no % 3
        if what == 1:
            self.decode.proc.kill()
            self.decode.proc.wait()
            self.decode = self._start("decode")
            return "decode daemon killed (-9) mid-round and restarted"
        if what == 2:
            return self._freeze(self.rng.uniform(LEASE_SPAN + HEARTBEAT_BOUND, LEASE_SPAN + HEARTBEAT_BOUND + 2), "past the lease and fence")
        return self._freeze(self.rng.uniform(0.5, 3.5), "")  # some freezes pass the heartbeat bound: deaths

    def _freeze(self, pause: float, note: str) -> str:
        self.prefill.freeze(True)
        time.sleep(pause)
        self.prefill.freeze(False)
        return f"prefill daemon frozen {pause:.1f}s mid-round{', ' + note if note else ''}"

    async def _round(self, round_no: int, spec: ChaosSpec) -> tuple[object, str]:
        rounds = asyncio.create_task(run_chaos(self.prefill.engine, self.decode.engine, self.prefill.bootstrap, spec))
        await asyncio.sleep(self.rng.uniform(0.3, 1.0))
        disturbance = await asyncio.get_running_loop().run_in_executor(None, self._disturb, round_no)
        return await rounds, disturbance

    def run(self) -> int:
        args = self.args
        self.runtime = tempfile.mkdtemp(prefix="pdxfer-soak-")
        totals: Counter = Counter()
        corruptions = caught = rooms = 0
        try:
            self.prefill, self.decode = self._start("prefill"), self._start("decode")
            start_rss = (rss_mib(self.prefill.pid), rss_mib(self.decode.pid))
            print(f"soak: {args.minutes:g} min, rounds of {args.rooms} rooms, faults {FAULTS} + aborts + daemon kills/freezes (a third past the lease)", flush=True)
            print(f"start RSS: prefill {start_rss[0]:.1f} MiB, decode {start_rss[1]:.1f} MiB", flush=True)
            deadline = time.monotonic() + args.minutes * 60
            round_no = 0
            while time.monotonic() < deadline:
                round_no += 1
                spec = ChaosSpec(rooms=args.rooms, in_flight=4, slots=4, abort_rate=0.1, seed=self.rng.randrange(1 << 30), client_timeout=5.0)
                report, disturbance = asyncio.run(self._round(round_no, spec))
                rooms += report.rooms
                corruptions += report.corruptions
                caught += report.caught_after_success
                totals.update(report.decode)
                print(
                    f"round {round_no:3d} [{disturbance}]: {report.line()}; RSS prefill {rss_mib(self.prefill.pid):.1f} MiB, "
                    f"decode {rss_mib(self.decode.pid):.1f} MiB",
                    flush=True,
                )
            leaks = []
            for daemon in (self.prefill, self.decode):
                stats = asyncio.run(settled_stats(daemon.engine, timeout=30))
                # A decode daemon restarted in the last round has no engine registered
                # again, so no aux slots at all: nothing there to leak.
                if sum(stats.rooms.values()) or (stats.slots and stats.slots.get("free") != 4):
                    leaks.append(f"{daemon.role}: rooms {stats.rooms}, slots {stats.slots}")
                    leaks.extend(held_rooms(daemon.ready["admin"]))
            end_rss = (rss_mib(self.prefill.pid), rss_mib(self.decode.pid))
        except LaunchError as exc:
            print(f"pdxfer soak: {exc}", file=sys.stderr)
            return 1
        finally:
            for daemon in (self.prefill, self.decode):
                if daemon is not None:
                    daemon.stop()
            for fh in self.logs.values():
                fh.close()
        summary = {
            "rooms": rooms,
            "decode outcomes": dict(totals),
            "caught after success": caught,
            "corruptions": corruptions,
            "leaks": leaks,
            "prefill RSS MiB": [round(start_rss[0], 1), round(end_rss[0], 1)],
            "decode RSS MiB (restarted daemons start over)": [round(start_rss[1], 1), round(end_rss[1], 1)],
        }
        print("summary: " + json.dumps(summary, indent=2))
        print(f"daemon logs kept in {self.runtime}")
        return 1 if corruptions or leaks else 0


def run_soak(args: argparse.Namespace) -> int:
    return Soak(args).run()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to run (default: 5)")
    parser.add_argument("--rooms", type=int, default=1000, help="rooms per round (default: 1000)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
