"""Ingress: how a request enters the router, up to the request context every later stage reads.

The front ends: HTTP served ahead of FastAPI's stack (http), the Responses WebSocket
(websocket) and KServe v2 gRPC (kserve). Each hands the pipeline an arrival (arrival: the
headers, peer, bounded body and the client's departure); the other two read its answer as
parts (internal_call). Here the caller becomes a tenant (auth: the API key, and with
it the residency zone), the body a bounded, parsed request (request), salted for the
tenant's own prefix cache (isolation); a Responses follow-up finds the replica that stored
its response (responses).
"""
