"""KV cache events leaving the node: vLLM-compatible ZMQ publishing with replay."""

from data_plane.kv_events.publisher import (
    DropOldestQueue,
    KVEventPublisherError,
    NullEventPublisher,
    ZmqEventPublisher,
    create_publisher,
)

__all__ = [
    "DropOldestQueue",
    "KVEventPublisherError",
    "NullEventPublisher",
    "ZmqEventPublisher",
    "create_publisher",
]
