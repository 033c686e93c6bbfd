"""Meridian's geo router: the global OpenAI-compatible endpoint.

It authenticates the tenant, applies residency as a hard filter, orders replicas by
estimated round-trip time and fails over before the first byte. It talks to the control
plane and to nodes over HTTP only.
"""

from .app import create_app, serve

__all__ = ["create_app", "serve"]
