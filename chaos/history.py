"""Drill histories: what the load generator, the routers and the nodes record, as JSON lines.

Three record types, told apart by `type`:

- `client`: one request as the load generator saw it. Times are seconds from the start of
  the load. A generator may append a record with no `outcome` when it sends a request
  and a complete one when it ends; the checker keeps the complete one, so a request
  whose end was never recorded still shows up as invoked.
- `routed`: a router sent attempt number `attempt` of a request to a node.
- `served`: a node finished working on a request; `completed` is false when it stopped
  before the end (aborted, client gone, crashed mid-way and recorded on the way down).
- `reference`: what a long greedy stream's prompt yields unbroken on a healthy fabric
  (chaos.streams asks it outside the measured window): the text the client must receive
  whole, with no token duplicated or missing, when the stream is migrated mid-generation.

A long stream's `client` record carries a `detail` (StreamDetail): everything it received.
A migrated stream's continuations are `routed` records with `migration` >= 1 (and the
generated tokens already delivered, `resume_tokens`); first pieces have migration 0.

Routers and nodes write their records with meridian.request_journal (the planes do not
import chaos); this module owns the format's validation. Files are append-only and every
line is flushed as it is written, so a process killed with
SIGKILL loses at most the line it was writing. Readers therefore forgive a torn last line
and nothing else: a bad line in the middle means the file was damaged or mis-written.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from meridian.request_journal import JsonLinesFile

log = logging.getLogger(__name__)


class HistoryError(ValueError):
    """A history file is malformed; the message names the file and line."""


class Outcome(StrEnum):
    """How a request ended for the client."""

    OK = "ok"  # a complete answer
    FAIL = "fail"  # a definite failure: an error status, or a stream that ended with an error event
    INDETERMINATE = "indeterminate"  # timeout or connection lost after sending: may or may not have run


@dataclass(frozen=True, slots=True)
class StreamDetail:
    """What a long stream received, for the token-exact comparison with its reference.

    `ids` are the distinct response `id`s seen (one for a stream migrated correctly);
    `migrations`, `final_node`, `final_region` come from the `meridian` field of the last
    event before [DONE] (absent, so 0 / None, on a stream that was not migrated).
    `longest_gap_s` is the longest silence between consecutive events after the first,
    ending at `longest_gap_end_s` (seconds from the load's start): a resumed stream's
    resume latency, kill or freeze included.
    """

    text: str = ""
    token_ids: tuple[int, ...] | None = None  # when the client asked return_token_ids
    ids: tuple[str, ...] = ()
    events: int = 0  # data events with a choice
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False  # data: [DONE] arrived
    error_code: str | None = None  # the SSE error event's code, when one ended the stream
    migrations: int = 0
    final_node: str | None = None
    final_region: str | None = None
    longest_gap_s: float | None = None
    longest_gap_end_s: float | None = None


@dataclass(frozen=True, slots=True)
class ClientOp:
    """One request as the load generator saw it (`outcome` None: sent, end not recorded)."""

    key: str  # the idempotency key
    tenant: str
    zone: str
    stream: bool
    invoke_s: float
    first_byte_s: float | None = None
    end_s: float | None = None
    outcome: Outcome | None = None
    status: int | None = None
    error_code: str | None = None  # OpenAI error JSON's `code` (or the stream error event's)
    retry_after: bool = False  # the answer carried a Retry-After header
    region: str | None = None  # x-meridian-region
    node: str | None = None  # x-meridian-node
    stream_error_event: bool = False  # the stream ended with an SSE error event
    detail: StreamDetail | None = None  # long streams only (chaos.streams)
    protocol: str = "http"  # how it was sent (chaos.protocols.PROTOCOLS)


@dataclass(frozen=True, slots=True)
class Routed:
    """A router sent one attempt of a request to a node (a migrated stream's continuation
    number `migration`, with `resume_tokens` generated tokens already delivered)."""

    key: str
    node: str
    region: str
    attempt: int
    migration: int = 0
    resume_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Served:
    """A node stopped working on a request, at the end (`completed`) or before it."""

    key: str
    node: str
    completed: bool
    # Only a P/D prefill hop for a decode worker: not the request's answer.
    prefill: bool = False


@dataclass(frozen=True, slots=True)
class Reference:
    """The unbroken answer to long stream `key`'s request on a healthy fabric.

    `prefill_s`, on the record of the longest prompt only: how long one prefill of it took
    alone on an idle fabric (a request for one token), the allowance a resume may add.
    """

    key: str
    text: str
    completion_tokens: int | None = None
    finish_reason: str | None = None
    token_ids: tuple[int, ...] | None = None
    prompt_tokens: int | None = None
    prefill_s: float | None = None


Record = ClientOp | Routed | Served | Reference


@dataclass(slots=True)
class History:
    """Records of one drill run from every source."""

    client: list[ClientOp] = field(default_factory=list)
    routed: list[Routed] = field(default_factory=list)
    served: list[Served] = field(default_factory=list)
    reference: list[Reference] = field(default_factory=list)

    def add(self, records: Iterable[Record]) -> History:
        """Sort records into their lists; returns self so reads can be chained."""
        for r in records:
            if isinstance(r, ClientOp):
                self.client.append(r)
            elif isinstance(r, Routed):
                self.routed.append(r)
            elif isinstance(r, Reference):
                self.reference.append(r)
            else:
                self.served.append(r)
        return self

    @classmethod
    def read(cls, *paths: str | Path) -> History:
        """Merge history files (client, router and node logs, in any combination)."""
        h = cls()
        for p in paths:
            h.add(read_records(p))
        return h


# --- the file boundary -------------------------------------------------------------------


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _DetailLine(_Line):
    text: str = ""
    token_ids: tuple[int, ...] | None = None
    ids: tuple[str, ...] = ()
    events: int = Field(0, ge=0)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False
    error_code: str | None = None
    migrations: int = Field(0, ge=0)
    final_node: str | None = None
    final_region: str | None = None
    longest_gap_s: float | None = None
    longest_gap_end_s: float | None = None


class _ClientLine(_Line):
    type: Literal["client"]
    key: str = Field(min_length=1)
    tenant: str
    zone: str
    stream: bool
    invoke_s: float
    first_byte_s: float | None = None
    end_s: float | None = None
    outcome: Outcome | None = None
    status: int | None = None
    error_code: str | None = None
    retry_after: bool = False
    region: str | None = None
    node: str | None = None
    stream_error_event: bool = False
    detail: _DetailLine | None = None
    protocol: Literal["http", "websocket", "grpc"] = "http"


class _RoutedLine(_Line):
    type: Literal["routed"]
    key: str = Field(min_length=1)
    node: str
    region: str
    attempt: int = Field(ge=1)
    migration: int = Field(0, ge=0)
    resume_tokens: int = Field(0, ge=0)


class _ServedLine(_Line):
    type: Literal["served"]
    key: str = Field(min_length=1)
    node: str
    completed: bool
    prefill: bool = False


class _ReferenceLine(_Line):
    type: Literal["reference"]
    key: str = Field(min_length=1)
    text: str
    completion_tokens: int | None = None
    finish_reason: str | None = None
    token_ids: tuple[int, ...] | None = None
    prompt_tokens: int | None = None
    prefill_s: float | None = None


_AnyLine = _ClientLine | _RoutedLine | _ServedLine | _ReferenceLine
_LINE: TypeAdapter[_AnyLine] = TypeAdapter(Annotated[_AnyLine, Field(discriminator="type")])
_TYPES: dict[type, str] = {ClientOp: "client", Routed: "routed", Served: "served", Reference: "reference"}


def _to_record(line: _AnyLine) -> Record:
    fields = line.model_dump(exclude={"type", "detail"})
    if isinstance(line, _ClientLine):
        detail = None if line.detail is None else StreamDetail(**line.detail.model_dump())
        return ClientOp(**fields, detail=detail)
    if isinstance(line, _RoutedLine):
        return Routed(**fields)
    if isinstance(line, _ReferenceLine):
        return Reference(**fields)
    return Served(**fields)


def decode(text: str) -> Record:
    """Parse one JSON line; raises ValueError (json or validation) when it is not a record."""
    return _to_record(_LINE.validate_json(text))


def iter_records(path: str | Path) -> Iterator[Record]:
    """Records of one file in order; a torn last line (no newline, unparsable) is skipped."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    # After the final newline split() leaves b"": a complete file. Anything else there is a
    # last line whose newline was never written.
    tail = lines.pop()
    for n, raw in enumerate(lines, start=1):
        try:
            yield decode(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise HistoryError(f"{path}:{n}: not a history record: {_reason(e)}") from None
    if tail:
        try:
            yield decode(tail.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            log.warning("%s:%d: ignoring a torn last line (the writer stopped mid-line)", path, len(lines) + 1)


def read_records(path: str | Path) -> list[Record]:
    """All records of one file (see iter_records)."""
    return list(iter_records(path))


def _reason(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, x['loc'])) or 'line'}: {x['msg']}" for x in e.errors())
    return str(e)


class HistoryWriter:
    """Append-only JSON-lines writer, one unbuffered write per line (a SIGKILL loses at most one line)."""

    def __init__(self, path: str | Path) -> None:
        self._file = JsonLinesFile(path)
        self.path = self._file.path

    def append(self, record: Record) -> None:
        self._file.append({"type": _TYPES[type(record)], **asdict(record)})

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
