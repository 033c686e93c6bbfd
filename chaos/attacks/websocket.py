"""Findings 2 and 3: Responses WebSocket warm-ups that store without limit, and a revoked key
that keeps its socket.

Warm-ups (finding 2). One socket with a valid key sends `response.create` turns with
`generate: false`, each ~0.9 MB of input (short messages, as a long conversation's history
is: each one a dict in the router's memory, several times its size on the wire) chaining on
the previous one (`previous_response_id`), so that the lane's stored conversation would grow
~0.9 MB a turn. Short form: at most 60 turns in 5 s; long form: 150 turns in 30 s (the
issue's 150 in 24.5 s). Cut off: the first turn answered with an `error` event (the lane's
or the socket's byte cap, the rate limit: a turn refused, nothing stored) or the socket
closed. Bound: 5 s. A turn takes 20-60 ms here, so a lane cap of the order of 10 MB
(`WS_MAX_LANE_BYTES`) is reached within a second; a lane that stores without end is never
cut off, and its RSS shows it (~3.5 MiB a turn).

Revoked key (finding 3). A socket opened with a fresh key stores one warm-up, the key is
revoked through the admin API, and the client goes on with small (64 KB) chained warm-ups,
ten a second. Short form: 5 s after the revocation; long form: 20 s. Cut off: the socket
closed, timed from the revocation; it must be closed with 1008 (policy violation). Bound:
5 s: the router learns of the revocation by its long-poll of the control plane (well under a
second on loopback) and the next turn checks the key. Turns the router refuses without
closing (a 401 `error` event) are counted, not taken for a cut-off: the socket, and what it
stored, would otherwise live on until the idle (300 s) or connection (60 min) limit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from chaos.attacks.form import Form
from chaos.attacks.result import Outcome
from chaos.attacks.target import AttackFabric
from meridian.admin_api import ApiKeyCreate, Scope
from meridian.admin_client import AdminClient

POLICY_VIOLATION = 1008
# A turn not answered within this ends the attack (the server is too busy to answer; the
# neighbour's figures say how busy).
TURN_TIMEOUT_S = 15.0
MODEL = "attack-model"
KEY_KNOWN_TIMEOUT_S = 15.0


class _Refused(Exception):
    """A turn was answered with an `error` event."""

    def __init__(self, event: dict[str, Any]) -> None:
        error = event.get("error") if isinstance(event.get("error"), dict) else {}
        super().__init__(f"error event {event.get('status')} {error.get('code') or error.get('type')}")


ITEM = {"type": "message", "role": "user", "content": "a" * 80}
ITEM_BYTES = len(json.dumps(ITEM)) + 2


def _turn(input_bytes: int, previous: str | None) -> str:
    """A warm-up of ~`input_bytes` of input: short messages, as a long conversation's history
    is (each item one dict in the router's memory, several times its size on the wire)."""
    event: dict[str, Any] = {"type": "response.create", "model": MODEL,
                             "input": [ITEM] * (input_bytes // ITEM_BYTES), "generate": False}
    if previous is not None:
        event["previous_response_id"] = previous
    return json.dumps(event)


async def _warm_up(ws: ClientConnection, message: str) -> str:
    """Send one warm-up; the id of the response it stored (_Refused when refused)."""
    await ws.send(message)
    async with asyncio.timeout(TURN_TIMEOUT_S):
        while True:
            event = json.loads(await ws.recv())
            if event.get("type") == "error":
                raise _Refused(event)
            if event.get("type") == "response.completed":
                return str(event["response"]["id"])


def _connect(url: str, key: str) -> websockets.asyncio.client.connect:
    ws_url = url.replace("http://", "ws://", 1) + "/v1/responses"
    # No compression: the bytes on the wire are the bytes the router must hold.
    return websockets.connect(ws_url, additional_headers={"authorization": f"Bearer {key}"}, open_timeout=10,
                              max_size=2**22, compression=None, proxy=None, close_timeout=2)


async def _once_known(url: str, key: str) -> ClientConnection:
    """A socket opened with a key just created: the router knows it once the control plane's
    next routing table reaches it (a long-poll, well under a second), 401 until then."""
    deadline = time.monotonic() + KEY_KNOWN_TIMEOUT_S
    while True:
        try:
            return await _connect(url, key)
        except websockets.InvalidStatus as refused:
            if refused.response.status_code != 401 or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.1)


async def _quiet(ws: ClientConnection, seconds: float) -> websockets.ConnectionClosed | None:
    """Wait `seconds` between turns; the close, when the router closes the socket meanwhile
    (as an idle key recheck would). Stray events are read and ignored."""
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            while True:
                await ws.recv()
    except TimeoutError:
        return None
    except websockets.ConnectionClosed as closed:
        return closed


def _closed(exc: websockets.ConnectionClosed) -> str:
    rcvd = exc.rcvd
    return f"close {rcvd.code}" if rcvd is not None else "closed without a close frame"


@dataclass(frozen=True)
class WarmUpFlood:
    target: str = "router"
    name: str = "ws_warmups"
    cut_off_bound_s: float = 5.0
    router_env: Mapping[str, str] = field(default_factory=dict)
    input_bytes: int = 900_000

    def seconds(self, form: Form) -> float:
        return 30.0 if form.long else 5.0

    def turns(self, form: Form) -> int:
        return 150 if form.long else 60

    async def run(self, fabric: AttackFabric, form: Form) -> Outcome:
        sent = stored = 0
        previous: str | None = None
        async with _connect(fabric.router.url, fabric.tenant_key) as ws:
            start = time.monotonic()
            deadline = start + self.seconds(form)
            how = "ran out of turns"
            cut: float | None = None
            try:
                for _ in range(self.turns(form)):
                    if time.monotonic() >= deadline:
                        how = "ran out of time"
                        break
                    message = _turn(self.input_bytes, previous)
                    sent += len(message)
                    previous = await _warm_up(ws, message)
                    stored += 1
            except _Refused as refused:
                cut, how = time.monotonic() - start, str(refused)
            except websockets.ConnectionClosed as closed:
                cut, how = time.monotonic() - start, _closed(closed)
            except TimeoutError:
                how = f"a turn not answered within {TURN_TIMEOUT_S:g} s"
            ran = time.monotonic() - start
        if cut is None:
            how = f"{how}: all {stored} turns stored ({stored * self.input_bytes / 1e6:.0f} MB)"
        return Outcome(sent, cut, how, ran, {"turns_stored": stored})


@dataclass(frozen=True)
class RevokedKeySocket:
    target: str = "router"
    name: str = "ws_revoked_key"
    cut_off_bound_s: float = 5.0
    router_env: Mapping[str, str] = field(default_factory=dict)
    input_bytes: int = 64_000
    interval_s: float = 0.1

    def seconds(self, form: Form) -> float:
        return 20.0 if form.long else 5.0

    async def run(self, fabric: AttackFabric, form: Form) -> Outcome:
        with AdminClient(fabric.control_plane.url, fabric.admin_key) as admin:
            created = await asyncio.to_thread(admin.create_key, ApiKeyCreate(
                name="attack-revoked", tenant="attack-revoked", zone="global", scopes=[Scope.INFERENCE],
                models=None, create_tenant=True))
            ws = await _once_known(fabric.router.url, created.key)
            async with ws:
                message = _turn(self.input_bytes, None)
                previous = await _warm_up(ws, message)
                sent = len(message)
                await asyncio.to_thread(admin.revoke_key, created.id)
                revoked = time.monotonic()
                return await self._after_revocation(ws, previous, sent, revoked, revoked + self.seconds(form))

    async def _after_revocation(self, ws: ClientConnection, previous: str, sent: int, revoked: float,
                                deadline: float) -> Outcome:
        stored = refused = 0
        how = "ran out of time"
        while time.monotonic() < deadline:
            message = _turn(self.input_bytes, previous)
            try:
                previous = await _warm_up(ws, message)
                stored += 1
            except _Refused:
                refused += 1
            except websockets.ConnectionClosed as closed:
                return self._closed_at(closed, sent, revoked, stored, refused)
            except TimeoutError:
                how = f"a turn not answered within {TURN_TIMEOUT_S:g} s"
                break
            sent += len(message)
            closed = await _quiet(ws, min(self.interval_s, deadline - time.monotonic()))
            if closed is not None:
                return self._closed_at(closed, sent, revoked, stored, refused)
        detail = {"turns_stored_after_revocation": stored, "turns_refused": refused}
        return Outcome(sent, None, f"{how}: open {time.monotonic() - revoked:.1f} s after the revocation, "
                       f"{stored} warm-ups stored, {refused} refused", time.monotonic() - revoked, detail)

    @staticmethod
    def _closed_at(closed: websockets.ConnectionClosed, sent: int, revoked: float, stored: int,
                   refused: int) -> Outcome:
        at = time.monotonic() - revoked
        code = closed.rcvd.code if closed.rcvd is not None else None
        how = _closed(closed)
        wrong = None if code == POLICY_VIOLATION else f"closed with {how}, not {POLICY_VIOLATION} (policy violation)"
        return Outcome(sent, at, how, at, {"turns_stored_after_revocation": stored, "turns_refused": refused},
                       wrong_kind=wrong)
