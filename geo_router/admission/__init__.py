"""Admission: whether an authenticated request may go on now.

A tenant's rate limits (requests and tokens per minute, geo_router.admission.ratelimit, the
bucket arithmetic in ratelimit_buckets) are charged here with the request's token estimate
(geo_router.admission.tokens) and settled with the answer's usage by accounting. This is
the stage where a flow-control queue (holding requests while the fleet is full) plugs in.
"""
