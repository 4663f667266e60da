"""Discovery and liveness through etcd (``--registry etcd://host:port[/prefix]``).

Each daemon puts one key, ``PREFIX/daemons/ROLE/NAME``, holding what a peer needs
(role, bootstrap address, transfer session, incarnation), under a lease it keeps
alive; if the daemon dies the lease lapses and the key goes. Every daemon watches
the other role's keys: decode daemons resolve prefill daemons by name, and a key
that disappears, or comes back under a new incarnation, tells its peers that
daemon is gone.

Speaks etcd's v3 JSON gateway over plain HTTP on the event loop (keys and values
are base64), so no etcd client library or gRPC is needed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

import msgspec

from ..core.config import RENEWALS_PER_TTL
from ..core.errors import PdxferError, Unsupported
from ..core.protocol import UNDECODABLE, ErrorCode, Role

log = logging.getLogger("pdxfer.registry")

MAX_RESPONSE = 16 * 1024 * 1024


class DaemonRecord(msgspec.Struct, frozen=True, kw_only=True):
    role: Role
    name: str
    incarnation: str
    bootstrap: str  # host:port of the bootstrap endpoint ("" for decode)
    session: str  # transfer engine session
    host: str


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: bytes) -> bytes:
    """The etcd range end that covers every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


@dataclass(frozen=True)
class RegistryAddress:
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> "RegistryAddress":
        parts = urlsplit(url)
        if parts.scheme != "etcd" or not parts.hostname or not parts.port:
            raise Unsupported(f"registry {url!r} is not etcd://host:port[/prefix]")
        return cls(parts.hostname, parts.port, parts.path.rstrip("/") or "/pdxfer")


class EtcdError(PdxferError):
    code = ErrorCode.PEER_UNREACHABLE


class EtcdClient:
    """The few etcd v3 gateway calls pdxfer needs."""

    def __init__(self, host: str, port: int, timeout: float = 5.0) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout

    async def _open(self, path: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, limit=MAX_RESPONSE), self.timeout)
        data = json.dumps(body).encode()
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data
        )
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            writer.close()
            raise EtcdError(f"etcd at {self.host}:{self.port} answered {status.decode(errors='replace').strip()} to {path}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers: the body is read as a stream or to the end
        return reader, writer

    async def call(self, path: str, body: dict) -> dict:
        try:
            reader, writer = await self._open(path, body)
            try:
                raw = await asyncio.wait_for(reader.read(), self.timeout)
            finally:
                writer.close()
        except (OSError, asyncio.TimeoutError) as exc:
            raise EtcdError(f"etcd at {self.host}:{self.port} is unreachable: {exc!r}") from None
        return json.loads(_dechunk(raw))

    async def grant(self, ttl: float) -> str:
        return (await self.call("/v3/lease/grant", {"TTL": max(1, int(round(ttl)))}))["ID"]

    async def keepalive(self, lease: str) -> float:
        reply = await self.call("/v3/lease/keepalive", {"ID": lease})
        return float(reply.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: str) -> None:
        await self.call("/v3/lease/revoke", {"ID": lease})

    async def put(self, key: bytes, value: bytes, lease: str) -> None:
        await self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": lease})

    async def range_prefix(self, prefix: bytes) -> tuple[list[tuple[bytes, bytes]], int]:
        reply = await self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        kvs = [(_unb64(kv["key"]), _unb64(kv.get("value", ""))) for kv in reply.get("kvs", [])]
        return kvs, int(reply["header"]["revision"])

    async def watch(self, prefix: bytes, start_revision: int, on_event: Callable[[str, bytes, bytes], None]) -> None:
        """Call ``on_event(kind, key, value)`` for every change under ``prefix`` after
        ``start_revision``; kind is PUT or DELETE (value: the previous one)."""
        request = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                      "start_revision": str(start_revision), "prev_kv": True}}
        reader, writer = await self._open("/v3/watch", request)
        try:
            async for line in _chunked_lines(reader):
                result = json.loads(line).get("result", {})
                for event in result.get("events", []):
                    kind = event.get("type", "PUT")
                    kv = event["kv"] if kind == "PUT" else event.get("prev_kv", event["kv"])
                    on_event(kind, _unb64(kv["key"]), _unb64(kv.get("value", "")))
        finally:
            writer.close()


def _dechunk(raw: bytes) -> bytes:
    """The body of a response that may use chunked transfer encoding."""
    if not raw or raw.lstrip()[:1] in (b"{", b"["):
        return raw
    out, rest = [], raw
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2 :]
    return b"".join(out)


async def _chunked_lines(reader: asyncio.StreamReader):
    """Newline-separated JSON objects from a chunked streaming response."""
    buffer = b""
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.strip().split(b";")[0] or b"0", 16)
        if size == 0:
            return
        buffer += await reader.readexactly(size)
        await reader.readexactly(2)
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            if line.strip():
                yield line


class Registry:
    """This daemon's key under a kept-alive lease, and a live view of the other role's daemons."""

    def __init__(self, url: str, ttl: float, on_gone: Callable[[DaemonRecord, str], None]) -> None:
        self.address = RegistryAddress.parse(url)
        self.ttl = ttl
        self.on_gone = on_gone  # (record that vanished or was replaced, why)
        self.client = EtcdClient(self.address.host, self.address.port)
        self.peers: dict[str, DaemonRecord] = {}  # by name, the other role's daemons
        self.record: DaemonRecord | None = None
        self._lease = ""
        self._decoder = msgspec.json.Decoder(DaemonRecord)

    def _key(self, role: Role, name: str = "") -> bytes:
        return f"{self.address.prefix}/daemons/{role.value}/{name}".encode()

    async def register(self, record: DaemonRecord) -> None:
        self.record = record
        self._lease = await self.client.grant(self.ttl)
        await self.client.put(self._key(record.role, record.name), msgspec.json.encode(record), self._lease)
        log.info("registered in etcd %s:%d as %s (lease %ss)", self.address.host, self.address.port, record.name, self.ttl)

    async def keep_alive(self) -> None:
        """Renew the lease at a third of its TTL; re-register if it was lost."""
        while True:
            await asyncio.sleep(self.ttl / RENEWALS_PER_TTL)
            if await self.client.keepalive(self._lease) <= 0:
                log.warning("etcd lease %s lapsed; registering again", self._lease)
                await self.register(self.record)

    async def watch(self) -> None:
        """Keep ``peers`` current; tell on_gone about daemons whose key went or changed hands."""
        other = Role.PREFILL if self.record.role is Role.DECODE else Role.DECODE
        prefix = self._key(other)
        kvs, revision = await self.client.range_prefix(prefix)
        self.peers = {r.name: r for r in (self._decoder.decode(v) for _, v in kvs)}
        await self.client.watch(prefix, revision + 1, self._changed)

    def _changed(self, kind: str, key: bytes, value: bytes) -> None:
        try:
            record = self._decoder.decode(value)
        except UNDECODABLE:
            log.warning("ignoring an unreadable registry entry at %r", key)
            return
        if kind == "DELETE":
            self.peers.pop(record.name, None)
            self.on_gone(record, f"its registry lease lapsed or it deregistered (incarnation {record.incarnation})")
            return
        old = self.peers.get(record.name)
        self.peers[record.name] = record
        if old is not None and old.incarnation != record.incarnation:
            self.on_gone(old, f"it registered again under a new incarnation ({old.incarnation} -> {record.incarnation})")

    def resolve(self, name: str) -> DaemonRecord:
        record = self.peers.get(name)
        if record is None:
            known = ", ".join(sorted(self.peers)) or "none"
            raise PdxferError(f"no daemon named {name!r} in the registry (known: {known})", code=ErrorCode.UNKNOWN_PEER)
        return record

    async def deregister(self) -> None:
        if self._lease:
            await self.client.revoke(self._lease)
            self._lease = ""
