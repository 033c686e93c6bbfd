"""Fault injectors used by chaos drills."""

from chaos.faults.tcp_proxy import (
    Direction,
    DirectionStats,
    FaultProxy,
    ProxyError,
    ProxyStats,
    running_proxy,
)

__all__ = [
    "Direction",
    "DirectionStats",
    "FaultProxy",
    "ProxyError",
    "ProxyStats",
    "running_proxy",
]
