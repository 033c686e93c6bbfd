"""One prober for all the workers of a router: the others read what it found.

Without it each of N workers probes every node on its own: N times the probes a node
answers (each a /metrics page rendered there and parsed here), for the same finding. With
it, one worker at a time leads: it holds the probe lease, an exclusive `flock` on a file in
the router's private state directory, which the kernel lets go of when that process dies
however it dies. The lead probes as a lone router does and appends what it learns to a
HostRing: each node's load (LOAD) and each region's smoothed round trip (RTT). The other
workers keep their probe schedule but skip the fetch, and merge the ring's news before they
read a load or a round trip (geo_router.state.probe's ProbeShare). A worker that does not
lead tries the lease once per probe interval, so when the lead dies a sibling probes again
within about one interval.

Ejections need nothing here: the lead's probe failures and healthy thresholds eject and
un-eject through the FleetState, which the workers already share (host_fleet, or Redis).
Times are CLOCK_MONOTONIC, one clock for the host's processes, as the prober's are.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import msgspec

from meridian.clock import SYSTEM_CLOCK, Clock

from ..state.node_load import NodeLoad
from .host_ring import HostRing, RingReader

# A record: what it is, then a node's load or a region's round trip.
_LOAD, _RTT = 1, 2
PAYLOAD_BYTES = 2048
DEFAULT_SLOTS = 1 << 11
_ENCODE = msgspec.msgpack.Encoder()
_DECODE = msgspec.msgpack.Decoder(list)


def create_ring(path: Path, slots: int = DEFAULT_SLOTS) -> None:
    HostRing.create(path, slots, PAYLOAD_BYTES)


class ProbeLease:
    """Whether this process leads the router's probing: an exclusive flock on `path`."""

    def __init__(self, path: Path, retry_s: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._retry_s = retry_s
        self._clock = clock
        self._held = False
        self._next_try = -float("inf")

    def held(self) -> bool:
        """True while this process holds the lease; tries to take it at most once per retry_s."""
        if self._held or self._fd is None:
            return self._held
        now = self._clock.monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + self._retry_s
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._held = True
        return True

    def release(self) -> None:
        """Let a sibling lead (a worker stopping); this one never leads again."""
        if self._fd is not None:
            os.close(self._fd)  # closing the file lets the lock go
            self._fd, self._held = None, False


class HostProbeShare:
    """The ProbeShare of one worker: the lease, and the ring of what the lead learnt."""

    def __init__(self, lease: ProbeLease, ring: RingReader) -> None:
        self._lease = lease
        self._ring = ring

    @classmethod
    def for_worker(cls, ring_path: Path, lease_path: Path, worker: int, retry_s: float,
                   clock: Clock = SYSTEM_CLOCK) -> HostProbeShare:
        return cls(ProbeLease(lease_path, retry_s, clock), RingReader(HostRing(ring_path), worker))

    def leads(self) -> bool:
        return self._lease.held()

    def release(self) -> None:
        self._lease.release()

    def tell_load(self, node_id: str, load: NodeLoad) -> None:
        self._tell([_LOAD, node_id, load.running, load.waiting, load.kv_usage, load.max_loras,
                    sorted(load.active_adapters), load.block_size, load.prefix_cache_hits,
                    load.prefix_cache_queries, load.observed_at])

    def tell_rtt(self, region: str, ms: float, at: float) -> None:
        self._tell([_RTT, region, ms, at])

    def news(self) -> tuple[list[tuple[str, NodeLoad]], list[tuple[str, float, float]]]:
        loads: list[tuple[str, NodeLoad]] = []
        rtts: list[tuple[str, float, float]] = []
        for payload in self._ring.news():
            try:
                record = _DECODE.decode(payload)
                if record[0] == _LOAD:
                    (_, node_id, running, waiting, kv_usage, max_loras, adapters, block_size, hits,
                     queries, observed_at) = record
                    loads.append((node_id, NodeLoad(running, waiting, kv_usage, max_loras, frozenset(adapters),
                                                    block_size, hits, queries, observed_at)))
                elif record[0] == _RTT:
                    _, region, ms, at = record
                    rtts.append((region, ms, at))
            except (msgspec.DecodeError, ValueError, TypeError):
                continue  # a record of another build of the router: the next probe corrects it
        return loads, rtts

    def _tell(self, record: list[object]) -> None:
        payload = _ENCODE.encode(record)
        if len(payload) > PAYLOAD_BYTES and record[0] == _LOAD:
            # Hundreds of active adapters: the siblings route by the rest of the load.
            record[6] = []
            payload = _ENCODE.encode(record)
        if len(payload) <= PAYLOAD_BYTES:
            self._ring.tell([payload])
