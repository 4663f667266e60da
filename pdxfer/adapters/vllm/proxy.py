"""pdxfer proxy: the router in front of disaggregated vLLM engines (docs/engines.md §C2).

For each OpenAI request (/v1/completions, /v1/chat/completions) it picks a room and, at
the same time, sends the prompt to a prefill engine with max_tokens=1 and
kv_transfer_params {"do_remote_decode": true, "room": R}, and to a decode engine with
{"do_remote_prefill": true, "room": R, "prefill_bootstrap": ..., "prefill_engine": ...,
"prefill_tp_size": ..., "prefill_pp_size": ...}: the prefill engine's sizes, which each of
its answers names (until a prefill engine first answered, a request's decode waits for
its prefill's answer). The prefill's KV reaches the decode through the two pdxfer daemons while the decode
waits; the client gets the decode's answer, streamed when it asked for a stream. When
one engine refuses the request or cannot be reached while the other works on it, the
other's request is closed (vLLM aborts it, and with it the room) and the client gets
the refusal, rather than waiting for the daemons' timeouts.

--sequential routes as NIXL's proxies do: the prefill first, with no room, then the
decode with the params the prefill answered (its connector picks the room).

Engines are taken in turn (round robin). /v1/models comes from a decode engine; /health
answers 200 while some prefill and some decode engine answer theirs, else 503, naming
each engine's state. Prints one JSON 'ready' line on stdout once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill vLLM engine's base URL (http://host:port), started with PdxferConnector as kv_producer; repeat for several")
    parser.add_argument("--bootstrap", action="append", default=[], metavar="HOST:PORT",
                        help="the bootstrap address of the pdxfer daemon beside each --prefill, in the same order (its ready line's 'bootstrap'); "
                        "not needed with --sequential, where each prefill answers with its own")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode vLLM engine's base URL, started with PdxferConnector as kv_consumer; repeat for several")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to serve on; 0 picks a free one (default: 8000)")
    parser.add_argument("--sequential", action="store_true",
                        help="prefill first, then decode with the params the prefill answered, as NIXL's proxies do (default: both at once)")


def run(args: argparse.Namespace) -> int:
    if args.bootstrap and len(args.bootstrap) != len(args.prefill):
        print(f"pdxfer proxy: {len(args.prefill)} --prefill but {len(args.bootstrap)} --bootstrap: give one --bootstrap per --prefill, in order",
              file=sys.stderr)
        return 2
    if not args.bootstrap and not args.sequential:
        print("pdxfer proxy: each --prefill needs its daemon's --bootstrap HOST:PORT (or route with --sequential)", file=sys.stderr)
        return 2
    try:
        from .routing import Prefill, Proxy, serve
    except ImportError as exc:
        print(f"pdxfer proxy needs aiohttp ({exc}): pip install 'pdxfer[proxy]'", file=sys.stderr)
        return 2
    bootstraps = args.bootstrap or [None] * len(args.prefill)
    prefills = [Prefill(url.rstrip("/"), bootstrap) for url, bootstrap in zip(args.prefill, bootstraps)]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(Proxy(prefills, [url.rstrip("/") for url in args.decode], args.sequential), args.host, args.port))
    return 0
