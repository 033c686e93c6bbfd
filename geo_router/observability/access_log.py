"""One log line per routed request at the router: logger `meridian.access`, level INFO.

Each inference request the router answers is one record, written when its answer is
complete (a stream: when it ends, however it ends), with the fields an operator looks a
request up by: `request_id`, `route`, `tenant`, `model`, `region` and `node` (the replica
that answered; empty when none did), `status`, `latency_ms` (from the request's arrival to
the answer's end), `stream`, and `prompt_tokens` / `completion_tokens` where the answer
reported them (a stream reports them only when the client asked for its usage chunk).
A stream that moved to other nodes mid-answer (geo_router.forwarding.migration) also has `migrations`,
`resumed_on` (the nodes it resumed on, in order, comma-separated; `node` is where it
began), `tokens_before_break` (generated before it first broke) and `tokens_after_resume`
(generated after that, by the resuming nodes); each move is logged when it happens too.
With `MERIDIAN_LOG_FORMAT=json` they are the JSON object's fields (meridian.logs).

It replaces uvicorn's access line for these routes (off at the router: it has none of
these fields); `MERIDIAN_ROUTER_ACCESS_LOG=false` turns it off, and a level above INFO on
`meridian.access` costs nothing but one check. Probes and scrapes are never logged.
Lines are written to stderr in batches, each at most 0.1 s after its request ended (and all
of them when the router stops): see meridian.logs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response

from meridian.contracts import HEADER_NODE, HEADER_REGION
from meridian.logs import FieldsRecord

from ..forwarding.streaming import when_stream_ends
from ..sse import StreamTally

log = logging.getLogger("meridian.access")

# Usage fields by API: OpenAI's, then the responses and Anthropic messages APIs'.
_USAGE_KEYS = (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens"))


@dataclass(slots=True)
class AccessRecord:
    """One request's line, filled in as the request goes (tenant and model once known)."""

    request_id: str
    route: str
    enabled: bool = True
    tenant: str = ""
    model: str = ""
    started: float = field(default_factory=time.perf_counter)

    def routed(self, response: Response, usage: dict[str, Any] | None) -> None:
        """A replica answered (`usage`: a whole answer's, accounting.answer_usage): log now,
        or when the stream ends."""
        if not (self.enabled and log.isEnabledFor(logging.INFO)):
            return
        if when_stream_ends(response, lambda tally: self._streamed(response, tally)):
            return
        self._emit(response.status_code, response.headers.get(HEADER_REGION, ""),
                   response.headers.get(HEADER_NODE, ""), usage, stream=False)

    def failed(self, status: int) -> None:
        """The router answered an error itself (no replica, rate limited, bad key…)."""
        if self.enabled and log.isEnabledFor(logging.INFO):
            self._emit(status, "", "", None, stream=False)

    def _streamed(self, response: Response, tally: StreamTally) -> None:
        self._emit(response.status_code, response.headers.get(HEADER_REGION, ""),
                   response.headers.get(HEADER_NODE, ""), tally.usage, stream=True, moved=_moves(tally))

    def _emit(self, status: int, region: str, node: str, usage: dict[str, Any] | None, *, stream: bool,
              moved: dict[str, Any] | None = None) -> None:
        latency_ms = round((time.perf_counter() - self.started) * 1000, 1)
        prompt, completion = _tokens(usage)
        fields = {"request_id": self.request_id, "route": self.route, "tenant": self.tenant,
                  "model": self.model, "region": region, "node": node, "status": status,
                  "latency_ms": latency_ms, "stream": stream,
                  "prompt_tokens": prompt, "completion_tokens": completion}
        if moved:
            fields.update(moved)
        # Built directly (meridian.logs.FieldsRecord): one line per request, at any rate.
        log.handle(FieldsRecord(log.name, logging.INFO, "%s %s %d %.1fms",
                                (self.route, self.model or "-", status, latency_ms), fields, batched=True))


def _moves(tally: StreamTally) -> dict[str, Any] | None:
    """A migrated stream's fields: where it resumed and the tokens before and after."""
    if not tally.moves:
        return None
    before = tally.moves[0].tokens_before
    return {"migrations": len(tally.moves), "resumed_on": ",".join(m.node for m in tally.moves),
            "tokens_before_break": before,
            "tokens_after_resume": None if tally.generated is None else tally.generated - before}


def _tokens(usage: dict[str, Any] | None) -> tuple[int | None, int | None]:
    if not usage:
        return None, None
    for prompt_key, completion_key in _USAGE_KEYS:
        prompt, completion = usage.get(prompt_key), usage.get(completion_key)
        if isinstance(prompt, int) or isinstance(completion, int):
            return (prompt if isinstance(prompt, int) else None,
                    completion if isinstance(completion, int) else None)
    return None, None
