"""Prefill/decode disaggregation at the router (issue 24; DESIGN.md).

A region whose replicas of a model include both a prefill pool (nodes of role `prefill`)
and a decode pool (role `decode`) serves a request in two hops: the prompt goes to a
prefill worker as a one-token, non-streamed request carrying `kv_transfer_params`
(meridian.kv_transfer); the prefill worker's answer says where the prompt's KV blocks are;
the original request then goes to a decode worker with those params, which pulls the
blocks and generates. Both workers are in one region, so KV never leaves the tenant's zone
(the candidates were filtered by residency before any of this).

- `pools` (pure): which candidates prefill, which decode, in what order; co-located when a
  pool is empty.
- `bodies` (pure): the prefill request made from the client's, the decode request with the
  hand-off added, and the refusal of a client that sends `kv_transfer_params` itself.
- `handoff` (I/O): the prefill hop with its failover, and releasing blocks nobody pulled.
- `flow`: one request's hand-offs across the forwarder's decode attempts.
"""
