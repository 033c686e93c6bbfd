"""Tenant rate limits shared exactly by the workers of one router: buckets in a mapped file.

The workers of `meridian router serve --workers N` (geo_router.workers) are processes on one
host, and a tenant's connections reach whichever worker the kernel hands them to. Dividing a
limit among the workers would refuse a tenant whose traffic is uneven; sharing it through
Redis (RedisRateLimiter) lets the workers together overshoot by a sync interval's traffic.
On one host it can be exact: each tenant's buckets live in a slot of one file that every
worker maps, and an admission reads, decides and writes the slot under an exclusive `flock`
of the file (two system calls, about a microsecond each, never held across an await). The
arithmetic is InProcessRateLimiter's, on the same `Bucket`s, so N workers admit exactly
what one router would.

The file (`BucketTable.create`, by the supervisor before it starts the workers): a header
(magic, slot count) and `slots` fixed-size slots. A tenant's slot is found by the first 16
bytes of BLAKE2b of its name, probing at most _PROBES slots from its hash. A slot idle past
the forget horizon is free again: by then its buckets are full, the same as a new tenant's.
With every probed slot held by a live tenant (far more live tenants than the table holds),
the tenant falls back to this worker's own buckets and a warning says so: its limit then
holds per worker, not per router, until a slot frees.

Time is the limiter's `Clock`: CLOCK_MONOTONIC is one clock for every process on the host,
so the workers' refills agree. With Redis set, the workers are routers of the Redis fleet
instead (RedisRateLimiter, whose overshoot bound then counts routers × workers).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import struct
from pathlib import Path

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import TenantEntry
from meridian.settings.router import RouterSettings

from ..admission.ratelimit import Admission, InProcessRateLimiter, RateLimiter, create_rate_limiter, refreshed
from ..admission.ratelimit_buckets import Bucket, LocalTenant, bucket_capacity
from . import WorkerSlot
from .mapped_file import MappedFile

log = logging.getLogger(__name__)

_MAGIC = b"MRDRLB01"
_HEADER = struct.Struct("<8sQ")
# key (16 bytes of BLAKE2b), used_at, then per bucket (requests, tokens): per-minute limit
# (0: none), level, updated_at. The capacity is derived (bucket_capacity), not stored.
_SLOT = struct.Struct("<16sd" + "qdd" * 2)
_EMPTY_KEY = bytes(16)
# Slots probed from a tenant's hash before it falls back to this worker's own buckets.
_PROBES = 16
DEFAULT_SLOTS = 1 << 14  # 16384 tenants live at once; 1.3 MiB


class BucketTable:
    """The mapped file: slots of tenant buckets, read and written under its flock."""

    def __init__(self, path: Path) -> None:
        self._file = MappedFile(path, "rate-limit bucket table", _is_table)
        self._map = self._file.map
        self.slots = _HEADER.unpack_from(self._map, 0)[1]

    @staticmethod
    def create(path: Path, slots: int = DEFAULT_SLOTS) -> None:
        """Write an empty table at `path` (private to the router's user)."""
        MappedFile.create(path, _HEADER.pack(_MAGIC, slots), _HEADER.size + slots * _SLOT.size)

    def lock(self) -> None:
        self._file.lock()

    def unlock(self) -> None:
        self._file.unlock()

    def find(self, key: bytes, now: float, forget_s: float) -> tuple[int, bool] | None:
        """The slot of `key` and whether it holds state (or a free one for it); None: the
        probed slots are all held by other live tenants. Between lock() and unlock() only."""
        start = int.from_bytes(key[:8], "little") % self.slots
        free: int | None = None
        for i in range(_PROBES):
            slot = (start + i) % self.slots
            held, used_at = _SLOT.unpack_from(self._map, self._offset(slot))[:2]
            if held == key:
                return slot, True
            if free is None and (held == _EMPTY_KEY or now - used_at >= forget_s):
                free = slot
        return None if free is None else (free, False)

    def read(self, slot: int, burst_s: float) -> LocalTenant:
        _, used_at, *buckets = _SLOT.unpack_from(self._map, self._offset(slot))
        return LocalTenant(_bucket(*buckets[:3], burst_s), _bucket(*buckets[3:], burst_s), used_at)

    def write(self, slot: int, key: bytes, state: LocalTenant) -> None:
        _SLOT.pack_into(self._map, self._offset(slot), key, state.used_at,
                        *_fields(state.requests), *_fields(state.tokens))

    @staticmethod
    def _offset(slot: int) -> int:
        return _HEADER.size + slot * _SLOT.size


def _is_table(mapped: mmap.mmap) -> bool:
    magic, slots = _HEADER.unpack_from(mapped, 0) if len(mapped) >= _HEADER.size else (b"", 0)
    return bool(magic == _MAGIC and len(mapped) == _HEADER.size + slots * _SLOT.size)


def _bucket(per_minute: int, level: float, updated_at: float, burst_s: float) -> Bucket | None:
    if per_minute == 0:
        return None
    return Bucket(per_minute, bucket_capacity(per_minute, burst_s), level, updated_at)


def _fields(bucket: Bucket | None) -> tuple[int, float, float]:
    return (0, 0.0, 0.0) if bucket is None else (bucket.per_minute, bucket.level, bucket.updated_at)


@functools.lru_cache(maxsize=1 << 16)
def tenant_key(name: str) -> bytes:
    return hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()


class HostRateLimiter(InProcessRateLimiter):
    """InProcessRateLimiter whose buckets are the host's BucketTable, shared by its workers."""

    def __init__(self, table: BucketTable, *, burst_s: float, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(burst_s=burst_s, clock=clock)
        self._table = table
        # What a locked call read, to write back before it unlocks: (slot, key, state).
        self._loaded: list[tuple[int, bytes, LocalTenant]] = []
        self._warned_full = False

    async def stop(self) -> None:
        """The table stays mapped until the process exits: a stream that ends while the app
        stops still settles its tokens."""

    def admit(self, tenant: TenantEntry, tokens: int) -> Admission:
        if tenant.requests_per_minute is None and tenant.tokens_per_minute is None:
            return super().admit(tenant, tokens)  # no limit: nothing to lock
        self._table.lock()
        try:
            return super().admit(tenant, tokens)
        finally:
            self._write_back()

    def charge(self, tenant: TenantEntry, tokens: int) -> None:
        self._table.lock()
        try:
            super().charge(tenant, tokens)
        finally:
            self._write_back()

    def settle(self, tenant: TenantEntry, estimated: int, actual: int) -> None:
        if tenant.tokens_per_minute is None or actual == estimated:
            return
        self._table.lock()
        try:
            super().settle(tenant, estimated, actual)
        finally:
            self._write_back()

    def _write_back(self) -> None:
        """Write what the locked call read, and unlock (refused or not: a refill computed
        is the same at every worker)."""
        try:
            for slot, key, state in self._loaded:
                self._table.write(slot, key, state)
        finally:
            self._loaded.clear()
            self._table.unlock()

    def _state(self, tenant: TenantEntry, now: float) -> LocalTenant:
        key = tenant_key(tenant.tenant)
        found = self._table.find(key, now, self._forget_s)
        if found is None:
            if not self._warned_full:
                self._warned_full = True
                log.warning("rate-limit table full near tenant %s: its limits hold per worker "
                            "until a slot frees", tenant.tenant)
            return super()._state(tenant, now)
        slot, held = found
        state = self._table.read(slot, self._burst_s) if held else LocalTenant(None, None, now)
        self._loaded.append((slot, key, state))
        return refreshed(state, tenant, self._burst_s, now)


def worker_rate_limiter(settings: RouterSettings, clock: Clock, worker: WorkerSlot) -> RateLimiter:
    """A worker's limiter: the Redis fleet's when `redis_url` is set, else the host's table."""
    if settings.redis_url:
        return create_rate_limiter(settings, clock)
    return HostRateLimiter(BucketTable(worker.buckets_path), burst_s=settings.rate_limit_burst_s, clock=clock)
