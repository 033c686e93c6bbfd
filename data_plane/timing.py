"""Kept for a branch in flight; the one implementation is meridian.clock.wait_at_most."""

from meridian.clock import wait_at_most

__all__ = ["wait_at_most"]
