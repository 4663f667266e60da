"""The event loop pdxfer's processes run on: uvloop where it is importable, else asyncio's."""

from __future__ import annotations

import asyncio


def run_uvloop(coro):
    """Run ``coro`` to completion on uvloop; its result."""
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; this only keeps odd platforms working
        return asyncio.run(coro)
    return uvloop.run(coro)
