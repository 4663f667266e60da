"""A small fault-injecting TCP proxy for tests: delay and "loss" on one TCP path.

Why not tc netem: it is not available in this kernel. Why "loss" is a reset: TCP
never loses bytes. A segment dropped on the wire is retransmitted by the kernel, so
an application on top of TCP (ZMQ, here) sees packet loss only as added latency or,
past the retransmission limits, as a connection that breaks. This proxy therefore
models loss as random connection resets (an RST to both sides, as a middlebox or a
peer's crash would produce) and delay as a fixed latency added to every chunk in
each direction (a delay line: throughput is not capped by it).

It runs as its own process, normally inside a network namespace
(``ip netns exec NS python tests/faultproxy.py ...``), forwards every connection
accepted on ``--listen`` to ``--target``, prints one JSON ``ready`` line with the
port it listens on, then takes commands on stdin, one JSON object a line:

    {"delay_ms": 50, "reset_prob": 0.05}   set faults (either key may be left out)
    {}                                      just report

and answers each with one JSON line: the faults now in force and counters
(``accepted``, ``resets``, ``chunks``, ``bytes``).

Bounded: at most ``MAX_CONNECTIONS`` connections at once (more are refused), at most
``QUEUE_CHUNKS`` chunks of at most ``CHUNK`` bytes buffered per direction (a full
delay line stops reading, so TCP flow control pushes back), and the process exits by
itself when its stdin closes or after ``--lifetime`` seconds, whichever comes first.

``FaultProxy`` is the test-side handle that starts and drives one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import subprocess
import sys
import threading

MAX_CONNECTIONS = 64
QUEUE_CHUNKS = 256
CHUNK = 64 * 1024


class _Reset(Exception):
    """Injected: break this connection with an RST."""


class Proxy:
    def __init__(self, target: tuple[str, int], seed: int) -> None:
        self.target = target
        self.delay = 0.0
        self.reset_prob = 0.0
        self.rng = random.Random(seed)
        self.counters = {"accepted": 0, "refused": 0, "resets": 0, "chunks": 0, "bytes": 0, "open": 0}

    def report(self) -> dict:
        return {"delay_ms": round(self.delay * 1000, 3), "reset_prob": self.reset_prob, **self.counters}

    def apply(self, command: dict) -> dict:
        if "delay_ms" in command:
            self.delay = max(0.0, float(command["delay_ms"])) / 1000
        if "reset_prob" in command:
            self.reset_prob = min(1.0, max(0.0, float(command["reset_prob"])))
        return self.report()

    async def handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            await self._handle(c_reader, c_writer)
        except asyncio.CancelledError:  # the proxy is exiting: just drop the connection
            _abort(c_writer, rst=False)

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        if self.counters["open"] >= MAX_CONNECTIONS:
            self.counters["refused"] += 1
            _abort(c_writer, rst=True)
            return
        self.counters["accepted"] += 1
        self.counters["open"] += 1
        u_writer = None
        try:
            try:
                u_reader, u_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), 5.0)
            except (OSError, asyncio.TimeoutError):
                _abort(c_writer, rst=True)
                return
            tasks = [
                asyncio.create_task(self._pipe(c_reader, u_writer)),
                asyncio.create_task(self._pipe(u_reader, c_writer)),
            ]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            reset = any(isinstance(t.exception(), _Reset) for t in done if not t.cancelled())
            if reset:
                self.counters["resets"] += 1
            _abort(c_writer, rst=reset)
            _abort(u_writer, rst=reset)
        finally:
            self.counters["open"] -= 1

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward one direction through a delay line; may end with _Reset."""
        loop = asyncio.get_running_loop()
        line: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)

        async def feed() -> None:
            try:
                while chunk := await reader.read(CHUNK):
                    await line.put((loop.time() + self.delay, chunk))
            except OSError:
                pass
            await line.put(None)

        feeder = asyncio.create_task(feed())
        try:
            while (item := await line.get()) is not None:
                due, chunk = item
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self.reset_prob and self.rng.random() < self.reset_prob:
                    raise _Reset()
                writer.write(chunk)
                await writer.drain()
                self.counters["chunks"] += 1
                self.counters["bytes"] += len(chunk)
        except OSError:
            pass
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)


def _abort(writer: asyncio.StreamWriter | None, rst: bool) -> None:
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if rst and sock is not None:
        try:  # linger 0: close() sends an RST instead of a FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


async def serve(listen: tuple[str, int], target: tuple[str, int], seed: int, lifetime: float) -> None:
    proxy = Proxy(target, seed)
    server = await asyncio.start_server(proxy.handle, *listen)
    port = server.sockets[0].getsockname()[1]
    print(json.dumps({"event": "ready", "port": port}), flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_command(line: str) -> None:
        try:
            reply = proxy.apply(json.loads(line or "{}"))
        except (ValueError, TypeError) as exc:
            reply = {"error": str(exc)}
        print(json.dumps(reply), flush=True)

    def read_stdin() -> None:  # a thread: stdin is a pipe from the test
        for line in sys.stdin:
            loop.call_soon_threadsafe(on_command, line.strip())
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=read_stdin, daemon=True).start()
    try:
        await asyncio.wait_for(stop.wait(), lifetime)
    except asyncio.TimeoutError:
        pass
    server.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="host:port to accept on (port 0: any)")
    parser.add_argument("--target", type=_address, required=True, help="host:port to forward to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lifetime", type=float, default=300.0, help="exit after this many seconds at the latest")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.listen, args.target, args.seed, args.lifetime))


class FaultProxy:
    """Test side: run the proxy (optionally under a command prefix such as
    ``ip netns exec NS``) and change its faults while it runs."""

    def __init__(self, listen: str, target: str, prefix: tuple[str, ...] = (), seed: int = 0, lifetime: float = 120.0) -> None:
        argv = [*prefix, sys.executable, __file__, "--listen", listen, "--target", target, "--seed", str(seed), "--lifetime", str(lifetime)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.host = listen.rpartition(":")[0]
        ready = self._line(10.0)
        if ready.get("event") != "ready":
            self.close()
            raise RuntimeError(f"fault proxy did not start: {ready}")
        self.port = ready["port"]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _line(self, timeout: float) -> dict:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not result or not result[0]:
            raise RuntimeError(f"fault proxy said nothing within {timeout:g}s (exit code {self.proc.poll()})")
        return json.loads(result[0])

    def set(self, **faults) -> dict:
        """Change faults (delay_ms, reset_prob); returns the proxy's report."""
        self.proc.stdin.write(json.dumps(faults) + "\n")
        self.proc.stdin.flush()
        return self._line(10.0)

    def stats(self) -> dict:
        return self.set()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    main()
