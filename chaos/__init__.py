"""Chaos drills: declarative fault drills and a Jepsen-style checker of request histories."""
