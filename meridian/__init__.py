"""Meridian: a multi-cloud, active-active serving fabric for large language models.

This package is the kernel: what every plane shares and nothing else. The wire contracts
(inference, admin API, KV events), settings, geography helpers, security primitives, the
one `Clock`, the one `Registry` of extension points and the one OpenAI error base. It
imports no plane, provider, composition root or tool (import-linter's `layers` contract
in `make test`); the CLI (`cli/`) and the local fabric (`localfabric/`) compose the planes.
"""

__version__ = "0.1.0"
