"""Meridian: a multi-cloud, active-active serving fabric for large language models.

This package holds what every plane shares: the wire contracts, settings, geography
helpers and the CLI. It never imports a plane (import-linter checks this in `make test`).
"""

__version__ = "0.1.0"
