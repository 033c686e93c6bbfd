"""Scopes an API key can carry."""

from __future__ import annotations

from enum import StrEnum


class Scope(StrEnum):
    ADMIN = "admin"  # manage API keys, and everything below
    OPERATOR = "operator"  # operate the fleet
    READ_ONLY = "read-only"  # look at nodes and regions
    INFERENCE = "inference"  # call the global OpenAI endpoint (checked by routers)


# Who may read the fleet's state through the admin API.
FLEET_READERS = frozenset({Scope.ADMIN, Scope.OPERATOR, Scope.READ_ONLY})
