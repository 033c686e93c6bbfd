"""Scopes an API key can carry: the enum is the admin API's (meridian.admin_api), shared
with its clients; who may read the fleet is the control plane's decision."""

from __future__ import annotations

from meridian.admin_api import Scope

__all__ = ["FLEET_READERS", "Scope"]

# Who may read the fleet's state through the admin API.
FLEET_READERS = frozenset({Scope.ADMIN, Scope.OPERATOR, Scope.READ_ONLY})
