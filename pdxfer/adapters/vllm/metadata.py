"""What the scheduler half hands the worker half each step (docs/engines.md §C3): plain
dataclasses, pickled to every worker with the scheduler's output."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .params import Sizes


@dataclass(frozen=True)
class Receive:
    """Decode: receive ``room`` into ``pages``, the request's blocks for page positions
    ``[skip_pages, skip_pages + len(pages))`` of its prompt; the first ``skip_pages``
    are the request's local prefix-cache hit. Every rank receives the same blocks, each
    its heads of them, from the prefill engine of ``prefill_sizes``."""

    req_id: str
    room: int
    bootstrap: str
    engine: str
    pages: tuple[int, ...]
    skip_pages: int
    prefill_sizes: Sizes = Sizes()


@dataclass(frozen=True)
class Transmit:
    """Prefill: send the prompt's KV, ``pages`` being its blocks in order, to ``room``
    (every rank its own heads of them)."""

    req_id: str
    room: int
    pages: tuple[int, ...]
    num_tokens: int


@dataclass
class PdxferMetadata(KVConnectorMetadata):
    receives: list[Receive] = field(default_factory=list)
    sends: list[Transmit] = field(default_factory=list)
    # Prefill rooms whose request ended without a send (an abort): the decode learns of it.
    aborts: list[int] = field(default_factory=list)
    # Decode requests that ended while their receive was in flight: abort the room, and
    # hold their blocks until it settled.
    cancels: list[str] = field(default_factory=list)
    # Nothing was scheduled this step: the worker may wait a little for a room to settle
    # instead of letting the engine spin.
    idle: bool = False
