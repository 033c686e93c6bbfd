"""A migratable stream: relayed event by event, and resumed elsewhere when its node fails.

When the piece on one node breaks (the connection drops, the node sends an error event,
or no event comes within the inter-token timeout) the stream is not ended: `decide` picks
the next replica of the request's own candidates (so, of the tenant's zone), the router
learns from that replica what text the ids so far make (`/detokenize`) to send on what the
client has not seen, and opens a /v1/completions stream there from the prompt's ids plus
the generated ids. The client sees one stream, one `id`, every token once.

A stream with tool calls moves only off and onto nodes that advertise the tool-call parser
the router replays (decide.py); on any other node it behaves as it did before streams could
move: it keeps the read timeout, and a break ends it with an error event (`tool_format`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ...selection.candidates import Candidate
from ...sse import SSEFramer, StreamMove, StreamTally, error_event, split_events
from ..streaming import StreamHost, run_close_callbacks
from ..upstream import FailureReason, UpstreamConnection, UpstreamError
from .budget import MigrationBudget
from .decide import (
    BreakReason,
    Move,
    Refusal,
    Refuse,
    decide,
    next_replica,
    replays_tool_calls,
    tool_replicas,
)
from .events import DONE, Continuation, encode, for_client, is_error, tool_seam
from .ledger import StreamLedger, unsent_tail
from .plain_events import IDS_KEY, Plain, PlainReader, plain
from .plan import COMPLETIONS_ROUTE, MigrationPlan
from .silence import SilenceWatch
from .tool_calls import ToolCallMismatch

log = logging.getLogger(__name__)

# Prompt ids decoded before the generated ones, so the seam's text is decoded in context
# (SentencePiece drops a leading space at the start of a sequence).
_DETOKENIZE_CONTEXT = 8
# A UTF-8 character is at most four bytes: at most this many byte tokens to step back over.
_MAX_CHAR_TOKENS = 4


@dataclass(slots=True)
class Piece:
    """The part of a stream one node is serving; `continuation` is None on the first node."""

    candidate: Candidate
    conn: UpstreamConnection
    framer: SSEFramer
    first: bytes
    ended: bool
    continuation: Continuation | None = None


class PieceFailed(Exception):
    """A continuation could not start on a replica; `reason` None: it refused it (4xx)."""

    def __init__(self, reason: FailureReason | None, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class MigrationHost(StreamHost, Protocol):
    """The forwarder's side of a migration: opening pieces and asking replicas."""

    inter_token_timeout_s: float
    max_migrations: int
    budget: MigrationBudget
    silence: SilenceWatch

    def is_ejected(self, node_id: str) -> bool: ...


    async def open_piece(self, candidate: Candidate, route: str, body: bytes, request_id: str, deadline: float,
                         trace_headers: str, migration: int, resume_tokens: int) -> Piece: ...

    async def detokenize(self, candidate: Candidate, model: str, tokens: list[int]) -> str | None: ...

    def end_piece(self, candidate: Candidate) -> None: ...

    def migrated(self, reason: BreakReason, source: Candidate, target: Candidate, tokens: int,
                 resume_s: float) -> None: ...

    def refused(self, why: Refusal) -> None: ...


@dataclass(frozen=True, slots=True)
class MigrationContext:
    """What a stream may move with: its plan, the request's candidates and trace headers;
    `responses_echo`: the request was a Responses one, served as chat (responses.py)."""

    plan: MigrationPlan
    candidates: Sequence[Candidate]
    request_id: str
    trace_headers: str = ""
    responses_echo: dict[str, Any] | None = None


class _Unresumable(Exception):
    """What was sent cannot be continued from the text the ids make (tool calls)."""


@dataclass(frozen=True, slots=True)
class _Seam:
    resume_at: int  # generated ids the continuation starts after
    held: str  # text before it the client was not sent
    text: str | None  # the text of the ids before it (None: the replica could not say)


class _Broken(Exception):
    def __init__(self, reason: BreakReason | None, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason  # None: the request's deadline passed (not the node's fault)


# Runs of a stream searched for a template event before it is read event by event for good.
_LEARN_TRIES = 4
# Events at the start of a run looked at for the template.
_LEARN_EVENTS = 4


class MigratingStream:
    """A CommittedStream (geo_router.forwarding.streaming) that survives the nodes serving it."""

    def __init__(self, host: MigrationHost, ctx: MigrationContext, piece: Piece, deadline: float,
                 received_at: float) -> None:
        self._host, self._ctx, self._piece = host, ctx, piece
        self._deadline, self._received_at = deadline, received_at
        self._ledger = StreamLedger(ctx.plan.api)
        self._plain = PlainReader(ctx.plan.api, ctx.plan.client_wants_token_ids)
        self._learn_tries = 0
        self._failed: set[str] = set()
        # Where it may continue: with tool calls, only on replicas whose parser is replayed.
        self._replicas = tool_replicas(ctx.candidates) if ctx.plan.tools else ctx.candidates
        self._migrations = 0
        self._complete = False
        self._closed = False
        self.tally = StreamTally()
        self.on_close: list[Callable[[StreamTally], None]] = []
        host.budget.begin_stream()
        host.silence.started(piece.candidate.node.node_id)

    async def body(self) -> AsyncIterator[bytes]:
        while True:
            try:
                async for out in self._relay(self._piece):  # counted by _events
                    yield out
                return
            except _Broken as broken:
                failure = broken
            out = await self._recover(failure)
            if out is not None:  # the stream ends here: its tail, or an error event
                self.tally.feed(out)
                yield out
                return

    async def _relay(self, piece: Piece) -> AsyncIterator[bytes]:
        run, ended = piece.first, piece.ended
        while True:
            if run:
                out, broken = self._events(piece, run)
                if out:
                    yield out  # what came before a break is the client's: the ledger counts it sent
                if broken is not None:
                    raise broken
                if self._complete:
                    return
            if ended:
                raise _Broken(BreakReason.CONNECTION, "the stream ended before [DONE]")
            chunk = await self._read(piece)
            run, ended = (piece.framer.feed(chunk), False) if chunk else (piece.framer.flush(), True)

    def _events(self, piece: Piece, run: bytes) -> tuple[bytes, _Broken | None]:
        """The client's bytes for a run of whole events from `piece`'s node, and the break
        that ended the run early, if one did. The tally counts them here: plain events by
        number, without looking for usage in them again."""
        if piece.continuation is not None:
            return self._counted(piece, run)
        # The first piece: events that match the stream's template in bulk (plain_events).
        if b"\r" in run:  # one memchr, where replace would count through the run
            run = run.replace(b"\r\n", b"\n")
        reader = self._plain
        if not reader.ready:
            if self._learn_tries < _LEARN_TRIES:
                self._learn_tries += 1
                self._learn(run)
            if not reader.ready:
                return self._counted(piece, run)
        out: list[bytes] = []
        for part in reader.split(run):
            if isinstance(part, Plain):
                if self._ledger.id is None:
                    self._ledger.read(reader.identity)
                self._ledger.read_plain(part.ids, part.texts)
                self.tally.events += part.events
                out.append(part.client)
                continue
            events, broken = self._counted(piece, part)
            out.append(events)
            if broken is not None or self._complete:
                return b"".join(out), broken
        return b"".join(out), None

    def _counted(self, piece: Piece, run: bytes) -> tuple[bytes, _Broken | None]:
        out, broken = self._each_event(piece, run)
        self.tally.feed(out)
        return out, broken

    def _learn(self, run: bytes) -> None:
        """Give the plain reader its template: the run's first plain event, if it has one
        among its first few (a stream's first event is the prompt's, then the plain ones).
        Only an event naming token ids once is parsed (not the prompt's, with its ids)."""
        at = 0
        for _ in range(_LEARN_EVENTS):  # only the run's first events, not all of it
            end = run.find(b"\n\n", at)
            if end < 0:
                return
            head, at = run[at:end + 2], end + 2
            if head.count(IDS_KEY) != 1:
                continue
            for raw, data in split_events(head):
                if data is not None and plain(data, self._ctx.plan.api):
                    self._plain.learn(raw, data)
                    return

    def _each_event(self, piece: Piece, run: bytes) -> tuple[bytes, _Broken | None]:
        """`_events`, reading each event whole."""
        plan, ledger, out = self._ctx.plan, self._ledger, bytearray()
        for raw, data in split_events(run):
            if data is None:
                if raw.startswith(b"data: [DONE]") or raw.startswith(b"data:[DONE]"):
                    if piece.continuation is not None and not piece.continuation.finished:
                        return bytes(out), _Broken(BreakReason.CONNECTION, "the continuation ended without a finish")
                    self._complete = True
                    return bytes(out + DONE), None
                out += raw
                continue
            if is_error(data):
                return bytes(out), _Broken(BreakReason.SERVER_ERROR, f"the node sent an error event: {str(data)[:200]}")
            if piece.continuation is None:
                ledger.read(data)
                out += raw if plan.client_wants_token_ids else encode(for_client(plan, data))
                continue
            try:
                events = piece.continuation.events(data)
            except ToolCallMismatch as exc:
                log.warning("request %s: the resumed text contradicts the tool calls sent (%s)",
                            self._ctx.request_id, exc)
                self._complete = True
                return bytes(out + error_event(
                    "The model server stopped responding in the middle of the answer; the resumed "
                    "answer did not match the tool calls already sent.", "upstream_disconnected")), None
            for event in events:
                ledger.read(event)
                out += encode(for_client(plan, event))
            if piece.continuation.finished:
                self._complete = True
                return bytes(out + DONE), None
        return bytes(out), None

    async def _read(self, piece: Piece) -> bytes:
        loop = asyncio.get_running_loop()
        # A stream that could not move anyway (no ids from its node, or tool calls read by a
        # parser the router does not replay) keeps the read timeout.
        movable = self._ledger.resumable and self._tool_format(piece.candidate)
        wait_s = self._host.inter_token_timeout_s if movable else self._host.read_timeout_s
        until = min(self._deadline, loop.time() + wait_s)
        try:
            chunk = await piece.conn.read_chunk_by(until)
            self._host.silence.heard(piece.candidate.node.node_id)
            return chunk
        except UpstreamError as exc:
            raise _Broken(BreakReason.CONNECTION, str(exc)) from None
        except TimeoutError:
            if loop.time() >= self._deadline:
                raise _Broken(None, "the request's deadline passed") from None
            raise _Broken(BreakReason.STALLED, f"no token for {wait_s:g}s") from None

    async def _recover(self, broken: _Broken) -> bytes | None:
        """Move the stream to the next replica (None), or its last bytes when it ends here."""
        broken_at = time.perf_counter()
        source = self._piece.candidate
        log.warning("request %s: node %s broke a stream (%s: %s)", self._ctx.request_id, source.node.node_id,
                    broken.reason, broken)
        self._host.note_failure(source, FailureReason.TIMEOUT if broken.reason is None else FailureReason.MIDSTREAM)
        if broken.reason is BreakReason.STALLED:
            self._host.silence.heard(source.node.node_id, stalled=True)
        self._failed.add(source.node.node_id)
        self._end_piece()
        ledger = self._ledger
        if ledger.finish_reason is not None:  # every token was sent: only the tail is missing
            self._complete = True
            tail = Continuation(self._ctx.plan, ledger, "", self._trailer(source)).tail(None)
            return b"".join(encode(for_client(self._ctx.plan, e)) for e in tail) + DONE
        reason = broken.reason or BreakReason.STALLED
        while True:
            loop = asyncio.get_running_loop()
            cost = len(ledger.prompt_ids or ()) + len(ledger.generated)
            replica = next_replica(self._replicas, self._failed, source.region.name, self._host.is_ejected,
                                   self._host.silence.is_suspect)
            decision: Move | Refuse = decide(
                resumable=ledger.resumable, migrations=self._migrations, max_migrations=self._host.max_migrations,
                replica=replica, time_left_s=self._deadline - loop.time(), tool_format=self._tool_format(source))
            if isinstance(decision, Move) and not await self._host.budget.acquire(cost):
                decision = Refuse(Refusal.BUDGET)
            if not isinstance(decision, Move):
                return self._refuse(decision.why, broken)
            try:
                piece = await self._resume(decision.candidate)
            except _Unresumable:
                return self._refuse(Refusal.NOT_RESUMABLE, broken)
            except PieceFailed as exc:
                log.warning("request %s: resuming on %s failed (%s)", self._ctx.request_id,
                            decision.candidate.node.node_id, exc)
                self._failed.add(decision.candidate.node.node_id)
                if exc.reason is not None:
                    self._host.note_failure(decision.candidate, exc.reason)
                continue
            finally:
                self._host.budget.release()
            self._moved(reason, source, decision.candidate, cost, time.perf_counter() - broken_at)
            self._piece = piece
            return None

    def _moved(self, reason: BreakReason, source: Candidate, target: Candidate, cost: int, resume_s: float) -> None:
        """Count, log and tally a move that started: the access line names where it went."""
        tokens = len(self._ledger.generated)
        self._host.migrated(reason, source, target, cost, resume_s)
        self.tally.moves.append(StreamMove(target.node.node_id, target.region.name, reason, tokens))
        log.info("request %s: stream moved from %s to %s after %d tokens (%s), resumed in %.2fs",
                 self._ctx.request_id, source.node.node_id, target.node.node_id, tokens, reason, resume_s,
                 extra={"request_id": self._ctx.request_id, "node": source.node.node_id,
                        "resumed_on": target.node.node_id, "region": target.region.name,
                        "tokens_before_break": tokens, "reason": str(reason)})

    async def _resume(self, target: Candidate) -> Piece:
        """Open the continuation on `target` (PieceFailed if it cannot start there)."""
        ledger, plan = self._ledger, self._ctx.plan
        seam = await self._seam(target)
        resume_at, held, tool_text = seam.resume_at, seam.held, None
        if plan.tools:
            tools = tool_seam(ledger, seam.text, plan.stops)
            if tools is None:
                raise _Unresumable
            tool_text, held = tools if tools[0] is not None else (None, held)
        ids = [*(ledger.prompt_ids or ()), *ledger.generated[:resume_at]]
        piece = await self._host.open_piece(target, COMPLETIONS_ROUTE, plan.continuation_body(ids, resume_at, target.node),
                                            self._ctx.request_id, self._deadline, self._ctx.trace_headers,
                                            self._migrations + 1, len(ledger.generated))
        self._migrations += 1  # only moves that started count against the limit
        repeated = len(ledger.generated) - resume_at
        piece.continuation = Continuation(plan, ledger, held, self._trailer(target), repeated, tool_text)
        return piece

    async def _seam(self, target: Candidate) -> _Seam:
        """Where the continuation starts (a count of generated ids), the text before it
        that the client has not been sent, and the whole text before it.

        A break can fall inside a character whose UTF-8 bytes span several tokens: the client
        has none of it yet (nodes hold half a character back), and a node primed with a
        prompt ending in half a character may mis-decode what follows (vLLM repeats the
        prompt's text). So the continuation starts at the last token boundary that decodes
        cleanly, and the ids it generates again are not counted twice (greedy and seeded
        generation give the same ones). Text held back for a possible stop string is asked
        of the replica's /detokenize: only streams with stop strings can have any. Streams
        with tools need the whole text: whether it is a call list decides how it goes on.
        """
        ledger, model = self._ledger, self._ctx.plan.model
        generated = ledger.generated
        if not generated:
            return _Seam(0, "", "")
        context = (ledger.prompt_ids or [])[-_DETOKENIZE_CONTEXT:]
        # The context's text and the whole text at once (one round trip to a busy replica);
        # stepping back over half a character is the rare case.
        head, full = await asyncio.gather(
            self._host.detokenize(target, model, context) if context else _text(""),
            self._host.detokenize(target, model, [*context, *generated]))
        text: str | None = None
        resume_at = len(generated)
        for back in range(min(_MAX_CHAR_TOKENS, len(generated)) + 1):
            if back:
                full = await self._host.detokenize(target, model, [*context, *generated[:len(generated) - back]])
            if full is None or head is None or not full.startswith(head):
                return _Seam(len(generated), "", None)  # the replica cannot say: continue where the ids end
            text = full[len(head):]
            if not text.endswith("\ufffd"):
                resume_at = len(generated) - back
                break
        if not self._ctx.plan.stops or text is None:
            return _Seam(resume_at, "", text)
        held = unsent_tail(text, ledger.delivered_text)
        if held is None:
            log.warning("request %s: the seam's text does not line up with what was sent; sending none of it",
                        self._ctx.request_id)
            return _Seam(resume_at, "", text)
        return _Seam(resume_at, held, text)

    def _refuse(self, why: Refusal, broken: _Broken) -> bytes:
        """The stream's last event when it may not move: an error event saying why."""
        self._host.refused(why)
        return error_event(f"The model server stopped responding in the middle of the answer "
                           f"({broken.reason or 'timeout'}); {_REFUSED[why]}.", "upstream_disconnected")

    def _tool_format(self, node: Candidate) -> bool:
        """Whether the router can replay what `node` makes of this stream's tool calls."""
        return not self._ctx.plan.tools or replays_tool_calls(node.node)

    def _trailer(self, node: Candidate) -> dict[str, object] | None:
        if not self._migrations:
            return None
        return {"migrations": self._migrations, "node": node.node.node_id, "region": node.region.name}

    def _end_piece(self) -> None:
        piece = self._piece
        self._host.release(piece.conn)
        self._host.end_piece(piece.candidate)

    async def close(self) -> None:
        """Release the current piece's connection (also when the client went away); idempotent."""
        if self._closed:
            return
        self._closed = True
        piece = self._piece
        if piece.candidate.node.node_id not in self._failed:
            self._host.release(piece.conn)
            self._host.finish(piece.candidate, time.perf_counter() - self._received_at)
            self._host.silence.ended(piece.candidate.node.node_id)
        self._host.end_request()
        self._host.budget.end_stream()
        self.tally.generated = len(self._ledger.generated)
        run_close_callbacks(self.on_close, self.tally)


_REFUSED = {
    Refusal.NOT_RESUMABLE: "this answer cannot be resumed elsewhere",
    Refusal.TOOL_FORMAT: "its tool calls are in a format that cannot be resumed elsewhere",
    Refusal.LIMIT: "it was resumed as many times as a request may be",
    Refusal.BUDGET: "the fabric is resuming too many answers to resume this one",
    Refusal.NO_REPLICA: "no other replica in your residency zone can resume it",
    Refusal.DEADLINE: "the request's time limit has passed",
}


async def _text(value: str) -> str:
    return value
