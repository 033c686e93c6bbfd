"""The router's state: what it knows of the fleet, kept off the request path's I/O.

The routing table and its snapshot (table, snapshot); node health and in-flight counts
(health), shared through Redis (redis_fleet, redis_sync); nodes' loads from their metrics
pages and the active probes that read them (node_load, probe); the exact KV-prefix index fed
by the nodes' KV events (kv_index, kv_scope, kv_subscriber) and the approximate routing
history (prefix_history). Request stages read it synchronously; background tasks write it.
"""
