"""The ``kv_transfer_params`` of a disaggregated vLLM request (docs/engines.md §C2).

The proxy picks a room and sends the same prompt to both engines at once:

    prefill: {"do_remote_decode": true, "room": R}                      (max_tokens=1)
    decode:  {"do_remote_prefill": true, "room": R,
              "prefill_bootstrap": "host:port", "prefill_engine": "<engine id>",
              "prefill_tp_size": T, "prefill_pp_size": P}

The prefill's response carries the decode's params (``answer``), its engine's TP and PP
sizes included, so a sequential NIXL-style proxy, which sends the prefill
``{"do_remote_decode": true}`` with no room and forwards what comes back to the decode,
works too. The decode's daemon needs those sizes to know which prefill ranks write
which heads of its pages (a size left out means 1). Keys of other connectors are ignored.

Pure: no vLLM, no pdxfer client; the proxy imports it without an engine installed.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_ROOM = 2**64 - 1  # pdxfer rooms are u64, 0 excluded
# Rooms this side picks stay below 2**53, so that a proxy whose JSON numbers are
# doubles (JavaScript, many routers) forwards them exactly.
PICKED_ROOMS = 2**53


@dataclass(frozen=True)
class Sizes:
    """An engine's tensor- and pipeline-parallel sizes."""

    tp: int = 1
    pp: int = 1


@dataclass(frozen=True)
class ToDecode:
    """A prefill request: compute the prompt, then send its KV to the room's decode."""

    room: int | None  # None: a sequential proxy named none; the connector picks one


@dataclass(frozen=True)
class FromPrefill:
    """A decode request: receive the prompt's KV from the prefill daemon at ``bootstrap``."""

    room: int
    bootstrap: str
    engine: str  # the prefill engine's id, for messages
    sizes: Sizes = Sizes()  # the prefill engine's


def new_room() -> int:
    return 1 + secrets.randbelow(PICKED_ROOMS - 1)


def _room(params: Mapping[str, Any], required: bool) -> int | None:
    room = params.get("room")
    if room is None and not required:
        return None
    if isinstance(room, bool) or not isinstance(room, int) or not 1 <= room <= MAX_ROOM:
        raise ValueError(f"kv_transfer_params room must be an integer in 1..2**64-1, not {room!r}")
    return room


def _size(params: Mapping[str, Any], key: str) -> int:
    size = params.get(key, 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"kv_transfer_params {key} must be a positive integer (the prefill engine's), not {size!r}")
    return size


def sizes_of(params: Mapping[str, Any]) -> Sizes:
    """The prefill's sizes named in ``params`` (a prefill's answer, or a decode's request)."""
    return Sizes(tp=_size(params, "prefill_tp_size"), pp=_size(params, "prefill_pp_size"))


def read(params: Mapping[str, Any] | None) -> ToDecode | FromPrefill | None:
    """What ``params`` ask of this engine: None for a request that is not disaggregated.
    Raises ValueError naming the field that is missing or malformed."""
    if not params:
        return None
    if params.get("do_remote_prefill"):
        bootstrap = params.get("prefill_bootstrap")
        if not isinstance(bootstrap, str) or not bootstrap.rpartition(":")[2].isdigit():
            raise ValueError(f"kv_transfer_params prefill_bootstrap must be 'host:port' (the prefill daemon's bootstrap address), not {bootstrap!r}")
        engine = params.get("prefill_engine", "")
        return FromPrefill(room=_room(params, required=True), bootstrap=bootstrap, engine=str(engine), sizes=sizes_of(params))
    if params.get("do_remote_decode"):
        return ToDecode(room=_room(params, required=False))
    return None


def for_prefill(room: int) -> dict[str, Any]:
    return {"do_remote_decode": True, "room": room}


def for_decode(room: int, bootstrap: str, engine: str, sizes: Sizes = Sizes()) -> dict[str, Any]:
    return {"do_remote_prefill": True, "room": room, "prefill_bootstrap": bootstrap, "prefill_engine": engine,
            "prefill_tp_size": sizes.tp, "prefill_pp_size": sizes.pp}


def answer(room: int, bootstrap: str | None, engine: str, sizes: Sizes) -> dict[str, Any]:
    """The prefill's ``kv_transfer_params`` in its response: the decode's request params
    (a sequential proxy forwards them as they are). Without a bootstrap address configured
    on the prefill, no ``prefill_bootstrap``: a parallel proxy knows it."""
    out = for_decode(room, bootstrap or "", engine, sizes)
    if bootstrap is None:
        del out["prefill_bootstrap"]
    return out
