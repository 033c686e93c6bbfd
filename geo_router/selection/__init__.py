"""Selection: which replicas may serve a request, and in which order to try them.

Residency first, as a hard filter (geo_router.selection.candidates: a zoned tenant's request
never sees a replica outside its zone), with health and the circuit breaker applied; then
the policy's order (policies) from what affinity knows of each candidate (affinity: load,
KV-prefix and LoRA-adapter hits, prefix keys from geo_router.selection.prefix); distances
from the client's location (locate); and, with no ready replica, the hold for one to scale
up (scale_from_zero). Selection reads the router's state (geo_router.state) and writes none
of it but the routing history affinity records.
"""
