"""Forwarding: one request's exchanges with the replicas selection ordered.

The forwarder (geo_router.forwarding.forwarder) is the failover loop: one attempt at a time
on pooled HTTP/1.1 connections (upstream, node_call), failing over before the first byte and
committing to a stream once its first event arrives (streaming, sse), within the overload
guards (outlier: circuit breaker, retry budget). Stream migration (migration: resuming a
broken stream on another replica) and prefill/decode disaggregation (disagg: a prefill hop
before each decode attempt) are strategies the loop calls.
"""
