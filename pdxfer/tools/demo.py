"""``pdxfer demo``: two daemons and two simulated engines on loopback, real KV
through the transfer engine over TCP, every byte checked, a summary at the end."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from .launch import DaemonProcess, LaunchError, read_events, start_daemon, start_sim, stop_all


class ProgressBar:
    """One line redrawn in place on a terminal; a line every few seconds otherwise."""

    def __init__(self, total: int, stream=sys.stderr) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.started = 0.0  # at the first room, so engine start-up does not count
        self.last = 0.0

    def update(self, done: int, nbytes: int, mismatches: int) -> None:
        now = time.monotonic()
        self.started = self.started or now
        if not self.tty and now - self.last < 2.0 and done < self.total:
            return
        self.last = now
        elapsed = now - self.started
        width = 30
        filled = int(width * done / max(1, self.total))
        rate = nbytes / elapsed / 1e9 if elapsed else 0.0
        text = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} rooms  {nbytes / 1e9:.2f} GB  {rate:.2f} GB/s  mismatches {mismatches}"
        self.stream.write(("\r" + text) if self.tty else text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")


def sim_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--rooms", str(args.rooms), "--in-flight", str(args.in_flight), "--layout", args.layout,
        "--layers", str(args.layers), "--page-size", str(args.page_size), "--token-bytes", str(args.token_bytes),
        "--pages", str(args.pages), "--max-tokens", str(args.max_tokens), "--seed", str(args.seed),
        "--slots", str(max(8, 2 * args.in_flight)),
    ]


def format_summary(args: argparse.Namespace, decode: dict, prefill: dict) -> str:
    ok = decode["outcome"].get("success", 0)
    failed = args.rooms - ok
    lines = [
        f"pdxfer demo: {args.rooms} rooms, {args.in_flight} in flight, layout {args.layout} "
        f"({args.layers} layers, {args.page_size} tokens/page, {args.token_bytes} B/token), aux path {args.aux_path}",
        f"  rooms succeeded     {ok} / {args.rooms}   failed {failed}",
        f"  bytes moved         {decode['bytes'] / 1e6:.1f} MB, every byte verified at the destination: {decode['mismatches']} mismatches",
        f"  throughput          {decode['gbps']:.2f} GB/s over {decode['seconds']:.2f} s",
        f"  bootstrap->Success  p50 {decode['p50_ms']:.2f} ms   p99 {decode['p99_ms']:.2f} ms",
        f"  outcomes            decode {json.dumps(decode['outcome'])}  prefill {json.dumps(prefill['outcome'])}",
    ]
    return "\n".join(lines)


def _show_logs(runtime: str, lines: int = 20) -> None:
    for role in ("prefill", "decode"):
        path = os.path.join(runtime, f"{role}.log")
        if os.path.exists(path):
            with open(path) as fh:
                tail = fh.readlines()[-lines:]
            print(f"--- last lines of the {role} daemon's log ---\n{''.join(tail)}", file=sys.stderr)


def run_demo(args: argparse.Namespace) -> int:
    runtime = tempfile.mkdtemp(prefix="pdxfer-demo-")
    daemons: list[DaemonProcess] = []
    sims: dict[str, subprocess.Popen] = {}
    try:
        flags = ["--aux-path", args.aux_path, "--log-level", "warning"]
        print(f"starting prefill and decode daemons (runtime dir {runtime}) ...", file=sys.stderr)
        logs = {role: open(os.path.join(runtime, f"{role}.log"), "w") for role in ("prefill", "decode")}
        prefill = start_daemon("prefill", runtime, *flags, stderr=logs["prefill"])
        daemons.append(prefill)
        decode = start_daemon("decode", runtime, *flags, stderr=logs["decode"])
        daemons.append(decode)
        print(
            f"prefill daemon pid {prefill.pid}: bootstrap {prefill.bootstrap}, transfer sessions {' '.join(prefill.ready['sessions'])}\n"
            f"decode daemon  pid {decode.pid}: transfer sessions {' '.join(decode.ready['sessions'])}\n"
            f"starting simulated prefill and decode engines ...",
            file=sys.stderr,
        )
        common = sim_flags(args)
        sims["prefill"] = start_sim("prefill", prefill.engine, *common)
        sims["decode"] = start_sim("decode", decode.engine, "--bootstrap", prefill.bootstrap, *common)
        bar = ProgressBar(args.rooms)

        def on_event(name: str, event: dict) -> None:
            if name == "decode" and event["event"] == "progress":
                bar.update(event["done"], event["bytes"], event["mismatches"])

        summaries = read_events(sims, on_event, watch={"the prefill daemon": prefill.proc, "the decode daemon": decode.proc})
        bar.finish()
    except LaunchError as exc:
        print(f"pdxfer demo: {exc}", file=sys.stderr)
        summaries = {}
    finally:
        for proc in sims.values():
            if proc.poll() is None:
                proc.kill()
        stop_all(daemons)
    if "decode" not in summaries or "prefill" not in summaries:
        print("pdxfer demo: a simulated engine exited without a summary (its errors are above)", file=sys.stderr)
        _show_logs(runtime)
        shutil.rmtree(runtime, ignore_errors=True)
        return 1
    shutil.rmtree(runtime, ignore_errors=True)
    dec, pre = summaries["decode"], summaries["prefill"]
    if args.json:
        print(json.dumps({"decode": dec, "prefill": pre}))
    else:
        print(format_summary(args, dec, pre))
    ok = dec["outcome"].get("success", 0) == args.rooms and pre["outcome"].get("success", 0) == args.rooms
    return 0 if ok and dec["mismatches"] == 0 else 1
