"""A minimal HTTP endpoint on the daemon's event loop: /metrics, /healthz, /readyz.

Small on purpose: GET only, one response per connection, bounded request size, so
a probe or a scraper can never hold the daemon up.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

log = logging.getLogger("pdxfer.http")

MAX_REQUEST = 8192
Route = Callable[[], tuple[int, str, bytes]]  # -> (status, content type, body)
REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request", 503: "Service Unavailable"}


class HttpEndpoint:
    def __init__(self, host: str, port: int, routes: dict[str, Route]) -> None:
        self.host = host
        self.port = port
        self.routes = routes
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_REQUEST)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            method, _, rest = head.decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            route = self.routes.get(path)
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain", b"GET only\n"
            elif route is None:
                status, ctype, body = 404, "text/plain", f"no {path}; try {', '.join(self.routes)}\n".encode()
            else:
                status, ctype, body = route()
            header = f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(header.encode() + (body if method == "GET" else b""))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            pass
        except Exception:  # H1: a bad route answers nothing; the daemon goes on
            log.exception("HTTP request failed")
        finally:
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
