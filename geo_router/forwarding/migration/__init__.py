"""Stream migration: a stream whose node fails after the first byte resumes on another
replica of the tenant's zone, token for token (issue 22).

`plan` decides which streams can move and what is asked of nodes so that they can;
`ledger` keeps what a stream carried; `events` parses the node's events and writes the
client's; `decide` is the pure choice of whether and where to move; `budget` bounds the
re-prefills a router may cause; `stream` is the I/O that ties them together for the
forwarder (geo_router.forwarding.forwarder). Why migration works from token ids rather than text: a
continuation from the exact ids is the unbroken generation (greedy decoding repeats it),
whatever the tokenizer would make of the text.
"""
