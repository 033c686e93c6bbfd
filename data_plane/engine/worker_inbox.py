"""What the torch engine's event-loop side sends its worker thread (commands through one
thread-safe inbox), and where the worker sends a request's outputs back (its client)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from data_plane.engine.base import GenerationOutput
from data_plane.engine.kv_transfer.payload import KVPayload
from data_plane.engine.sequence import Sequence
from meridian.stop_strings import StopStringMatcher
from meridian.tokenizer import IncrementalDetokenizer

Item = GenerationOutput | BaseException


@dataclass(eq=False)
class Client:
    """The consumer side of a request: where its outputs go and how text is cut."""

    outbox: asyncio.Queue[Item]
    detokenizer: IncrementalDetokenizer
    stopper: StopStringMatcher


@dataclass(frozen=True, slots=True)
class Add:
    seq: Sequence


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class HeldKVCommand:
    """Export (then release) or just release a held handle; the answer goes to `done`."""

    handle: str
    export: bool
    done: asyncio.Future[KVPayload | bool | None]


Command = Add | Abort | Stop | HeldKVCommand
