"""Finding 1: HTTP/1.1 pipelining with no bound, on the router and on the control plane.

The attack: one connection, no key, `GET /health` requests written back to back as fast as
the server takes them, never reading an answer (its receive buffer capped at 64 KiB, so
answers back up at once). Short form: at most 200,000 requests (6.6 MB) in 3 s; long form:
600,000 (19.8 MB) in 10 s, the issue's 539,600 in 10.8 s.

Cut off: the server closes the connection, or reads at most READ_BOUND_BYTES of a flood
larger than that (the rest waits in the kernel, unread). Why a bound on bytes and not on
time: a listener that bounds the requests parsed and waiting on a connection reads only as
fast as its answers leave, and once the client's buffers are full the answers wait in the
server's socket send buffer, which the kernel autotunes up to tcp_wmem's maximum (4 MiB
here) over several seconds: it reads on, slower and slower, until that is full. Each
answer is about three times its 33-byte request, so that is some 1.3 MB of requests: the
bounded listener read 1.2 MB of a 10 s, 5.7 MB flood and last read at 5.6 s. Unbounded, it
read all it was sent (6.6 MB in 3 s). The cut-off time reported is when it last read
(the attack's end if it still read then).

On code without the bound (b4d2a0b), uvicorn's httptools protocol parses every request of
every chunk it reads into an unbounded deque and reads on after each answer: the server
takes the whole flood, its memory grows with it and one core is spent parsing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from chaos.attacks import wire
from chaos.attacks.form import Form
from chaos.attacks.result import Outcome
from chaos.attacks.target import AttackFabric

REQUEST = b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n"
PER_WRITE = 1000
STALL_S = 1.0
RCVBUF = 64 * 1024
READ_BOUND_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class PipelinedFlood:
    target: str = "router"
    name: str = "pipelining"
    # The long form's 10 s: what binds is READ_BOUND_BYTES (see above).
    cut_off_bound_s: float = 10.0
    router_env: Mapping[str, str] = field(default_factory=dict)

    def seconds(self, form: Form) -> float:
        return 10.0 if form.long else 3.0

    def requests(self, form: Form) -> int:
        return 600_000 if form.long else 200_000

    async def run(self, fabric: AttackFabric, form: Form) -> Outcome:
        listener = fabric.listener(self.target)
        _reader, writer = await wire.connect(listener.host, listener.port, rcvbuf=RCVBUF)
        start = time.monotonic()
        deadline = start + self.seconds(form)
        try:
            poured = await wire.pour(writer, REQUEST * PER_WRITE, self.requests(form) * len(REQUEST), deadline)
            if poured.broken_at is None:
                await wire.hold(deadline)  # the flood's requests wait on the server until the end
        finally:
            await wire.close(writer)
        ran = time.monotonic() - start
        outcome = wire.flood_outcome(poured, start, ran, STALL_S, "requests", len(REQUEST))
        if poured.read > READ_BOUND_BYTES:
            return replace(outcome, wrong_kind=f"the server read {poured.read:,} bytes of it; bound {READ_BOUND_BYTES:,}")
        if outcome.cut_off_s is not None or poured.accepted <= READ_BOUND_BYTES:
            return outcome
        return replace(outcome, cut_off_s=min(poured.last_progress - start, ran),
                       how=f"read {poured.read:,} of {poured.accepted:,} bytes (the rest left unread)")
