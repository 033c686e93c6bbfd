"""Errors of the weight store and node cache, each with a message an operator can act on."""

from __future__ import annotations

import asyncio


class WeightStoreError(Exception):
    """A model could not be pushed, pulled or loaded from the cache."""


class CacheFullError(WeightStoreError):
    """The cache's disk budget or the disk itself cannot hold what must be written."""


class IntegrityError(WeightStoreError):
    """Bytes do not match the manifest's digest."""


class ResidencyError(WeightStoreError):
    """The model, origin or peer is outside the residency zone the node may use."""


class FetchError(WeightStoreError):
    """A range could not be fetched from any source after every retry."""


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first real failure inside a TaskGroup's exception group (not a cancellation)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]
