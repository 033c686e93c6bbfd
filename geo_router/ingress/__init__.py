"""Ingress: how a request enters the router (its front ends, before admission and selection)."""
