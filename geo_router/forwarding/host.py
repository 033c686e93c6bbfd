"""What the streams, migrations and prefill hops a forward starts ask of the router.

The failover loop (geo_router.forwarding.forwarder) chooses and tries replicas; what happens
after it committed belongs to the stream passing the answer on (streaming.PassThroughStream),
a migrating stream (migration.stream.MigratingStream) or a prefill hop (disagg.handoff). They
all need the same few things of the router, which ForwardingHost gives them (StreamHost,
MigrationHost and PrefillHost in one): the fleet's books (in-flight counts, failures that may
eject a node, answers that forgive one), the pooled node calls, the migration budget and
silence watch, the request journal, the retry budget and the metrics those record.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.request_journal import RequestJournal
from meridian.settings.router import RouterSettings

from ..ingress.request import InferenceRequest
from ..observability.metrics import RouterMetrics
from ..selection.candidates import Candidate
from ..sse import SSEFramer
from ..state.health import FailureKind, FleetState
from .migration.budget import MigrationBudget
from .migration.decide import BreakReason, Refusal
from .migration.silence import SilenceWatch
from .migration.stream import Piece, PieceFailed
from .node_call import NodeCaller
from .outlier import RetryBudget
from .upstream import FailureReason, UpstreamConnection, UpstreamError

log = logging.getLogger(__name__)


class ForwardingHost:
    """The router's side of committed streams, stream migrations and prefill hops."""

    def __init__(self, settings: RouterSettings, fleet: FleetState, metrics: RouterMetrics, calls: NodeCaller, *,
                 journal: RequestJournal, retry_budget: RetryBudget | None, clock: Clock = SYSTEM_CLOCK) -> None:
        self._settings = settings
        self._fleet = fleet
        self._metrics = metrics
        self._calls = calls
        self._journal = journal
        self._retry_budget = retry_budget
        self.clock = clock
        self.read_timeout_s = settings.read_timeout_s
        self.inter_token_timeout_s = settings.inter_token_timeout_s
        self.max_migrations = settings.migration_max_per_request
        self.silence = SilenceWatch(settings.inter_token_timeout_s)
        self.budget = MigrationBudget(
            clock, percent=settings.migration_budget_percent, min_concurrency=settings.min_migration_concurrency,
            tokens_per_s=settings.migration_budget_tokens_per_s, burst_tokens=settings.migration_budget_burst_tokens,
            queue_timeout_s=settings.migration_queue_timeout_s)

    # --- every committed stream (geo_router.forwarding.streaming.StreamHost) ---

    def note_failure(self, candidate: Candidate, reason: FailureReason) -> None:
        node = candidate.node.node_id
        # Nothing listening ejects at once; a 5xx, timeout or broken stream only after
        # several in a row (health.py), since one may be the request's own doing.
        kind = FailureKind.UNREACHABLE if reason is FailureReason.CONNECT else FailureKind.ERROR
        ejected_s = self._fleet.record_failure(node, kind)
        self._metrics.upstream_failures.labels(candidate.region.name, node, reason).inc()
        if ejected_s > 0:
            log.info("node %s ejected for %.1fs after a %s failure", node, ejected_s, reason)

    def finish(self, candidate: Candidate, elapsed_s: float) -> None:
        self._fleet.end(candidate.node.node_id)
        self._metrics.child("latency", candidate.region.name).observe(elapsed_s)

    def end_request(self) -> None:
        """A client request's answer is complete (or failed): it leaves the retry budget."""
        if self._retry_budget is not None:
            self._retry_budget.end_request()

    def release(self, conn: UpstreamConnection) -> None:
        """An exchange is over: its connection goes back to the pool (or is closed)."""
        self._calls.release(conn)

    # --- the host of prefill hops (geo_router.forwarding.disagg.handoff.PrefillHost) ---

    def prefill_began(self, candidate: Candidate) -> None:
        self._fleet.begin(candidate.node.node_id)

    def prefill_ended(self, candidate: Candidate, ok: bool) -> None:
        self._fleet.end(candidate.node.node_id)
        if ok:
            self._fleet.record_success(candidate.node.node_id)

    # --- the host of migrating streams (geo_router.forwarding.migration.stream.MigrationHost) ---

    def is_ejected(self, node_id: str) -> bool:
        return self._fleet.is_ejected(node_id)

    def end_piece(self, candidate: Candidate) -> None:
        self._fleet.end(candidate.node.node_id)
        self.silence.ended(candidate.node.node_id)

    def migrated(self, reason: BreakReason, source: Candidate, target: Candidate, tokens: int,
                 resume_s: float) -> None:
        self._metrics.migrations.labels(reason, source.region.name, target.region.name).inc()
        self._metrics.reprefill_tokens.inc(tokens)
        self._metrics.resume_latency.observe(resume_s)

    def refused(self, why: Refusal) -> None:
        self._metrics.migrations_refused.labels(why).inc()

    async def open_piece(self, candidate: Candidate, route: str, body: bytes, request_id: str, deadline: float,
                         trace_headers: str, migration: int, resume_tokens: int) -> Piece:
        """Start a continuation on `candidate` and read its first event (PieceFailed if not)."""
        node = candidate.node.node_id
        try:
            origin = self._calls.client.origin(candidate.node.url)
        except ValueError as exc:
            raise PieceFailed(FailureReason.PROTOCOL, str(exc)) from None
        head = self._calls.request_head("POST", origin, route, InferenceRequest(body, "", True, {}), request_id,
                                        trace_headers)
        await self._calls.take_slot()
        self._fleet.begin(node)
        self._journal.routed(request_id, node, candidate.region.name, 1, migration=migration,
                             resume_tokens=resume_tokens)
        conn: UpstreamConnection | None = None
        started = False
        try:
            async with asyncio.timeout_at(deadline):
                conn = await self._calls.exchange(origin, head, body, True, self.inter_token_timeout_s)
                status, _ = await conn.status()
                if status >= 300:
                    detail = (await conn.read_all())[:300].decode("utf-8", "replace")
                    raise PieceFailed(FailureReason.SERVER_ERROR if status >= 500 else None, f"HTTP {status}: {detail}")
                framer = SSEFramer(True)
                # A frozen replica must not hold a resumed stream longer than it held the first.
                first, ended = await self._calls.first_event(conn, framer, self.inter_token_timeout_s)
                started = True
        except UpstreamError as exc:
            raise PieceFailed(exc.reason, str(exc)) from None
        except TimeoutError:
            raise PieceFailed(FailureReason.TIMEOUT, "the request's deadline passed") from None
        finally:
            if not started:
                self._calls.release(conn)
                self._fleet.end(node)
        self._fleet.record_success(node)
        self.silence.started(node)
        return Piece(candidate, conn, framer, first, ended)

    async def detokenize(self, candidate: Candidate, model: str, tokens: list[int]) -> str | None:
        """The text `tokens` make on `candidate` (POST /detokenize); None when it answers but
        cannot say; PieceFailed when it does not answer (the stream should go elsewhere)."""
        body = msgspec.json.encode({"model": model, "tokens": tokens})
        # A healthy node answers in milliseconds; a frozen one must not hold the stream long.
        timeout_s = min(self.inter_token_timeout_s, self._settings.connect_timeout_s + 1.0)
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            status, _, answer = await self._calls.whole(candidate.node.url, "POST", "/detokenize", body, deadline)
        except ValueError as exc:  # the node's URL
            raise PieceFailed(FailureReason.PROTOCOL, str(exc)) from None
        except UpstreamError as exc:
            raise PieceFailed(exc.reason, f"detokenize: {exc}") from None
        except TimeoutError:
            raise PieceFailed(FailureReason.TIMEOUT, f"detokenize: no answer within {timeout_s:g}s") from None
        try:
            text = msgspec.json.decode(answer).get("prompt") if status == 200 else None
        except (msgspec.DecodeError, AttributeError):
            text = None
        if not isinstance(text, str):
            log.warning("detokenize on %s answered %s without text", candidate.node.node_id, status)
            return None
        return text
