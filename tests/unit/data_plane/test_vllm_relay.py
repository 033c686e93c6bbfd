"""Decoding vLLM's KV events (every layout vLLM has published), the relay thread, and
reading vLLM's /metrics into EngineStats."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
import zmq

from data_plane.engine.vllm.metrics import StatsTracker, drop_metric_families, parse_vllm_metrics
from data_plane.engine.vllm.relay import KVEventDecodeError, KVEventRelay, decode_vllm_batch
from data_plane.engine.vllm.supervisor import RestartPolicy
from meridian.block_hash import hash_block
from meridian.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from meridian.ports import free_port

ENC = msgspec.msgpack.Encoder()


def test_current_array_layout_round_trips() -> None:
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored([11, 12], None, list(range(32)), 16, None, "GPU", "sql"),
        BlockRemoved([9], "GPU"),
        AllBlocksCleared(),
    ], data_parallel_rank=0)
    assert decode_vllm_batch(encode_batch(batch)) == batch


def test_older_array_layout_without_medium_and_lora_name() -> None:
    # vLLM 0.8/0.9: BlockStored had 5 fields, BlockRemoved 1, no data_parallel_rank.
    payload = ENC.encode([2.0, [["BlockStored", [5], 4, [1, 2], 2, None], ["BlockRemoved", [3]]]])
    batch = decode_vllm_batch(payload)
    assert batch.ts == 2.0 and batch.data_parallel_rank is None
    assert batch.events == [BlockStored([5], 4, [1, 2], 2, None, None, None), BlockRemoved([3], None)]


def test_newer_array_layout_with_trailing_fields() -> None:
    payload = ENC.encode([3.0, [["BlockStored", [b"\x01\x02"], None, [7], 1, None, "GPU", None, [None], 0,
                                "full_attention"]], 0])
    (event,) = decode_vllm_batch(payload).events
    assert event == BlockStored([b"\x01\x02"], None, [7], 1, None, "GPU", None, [None])


def test_map_layout_after_vllm_42892() -> None:
    stored = {"type": "BlockStored", "block_hashes": [15760518052499183552], "parent_block_hash": None,
              "token_ids": [151644, 872], "block_size": 2, "lora_id": None, "medium": "GPU",
              "lora_name": "sql", "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    events: list[Any] = [stored, {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0},
                         {"type": "AllBlocksCleared"}, {"type": "SomethingNewer", "x": 1}]
    for outer in ([4.0, events, 0], {"ts": 4.0, "events": events, "data_parallel_rank": 0}):
        batch = decode_vllm_batch(ENC.encode(outer))
        assert batch.events == [
            BlockStored([15760518052499183552], None, [151644, 872], 2, None, "GPU", "sql", [None]),
            BlockRemoved([1], "GPU"),
            AllBlocksCleared(),
        ]
        assert batch.data_parallel_rank == 0


@pytest.mark.parametrize("payload", [b"\xc1", ENC.encode("hello"), ENC.encode([1.0, "x"]),
                                     ENC.encode([1.0, [["BlockStored", "not-a-list", None, [], 1]]])])
def test_garbage_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_vllm_batch(payload)


class ListSink:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []
        self._lock = threading.Lock()

    def publish(self, batch: KVEventBatch) -> None:
        with self._lock:
            self.batches.append(batch)

    def events(self) -> list[Any]:
        with self._lock:
            return [e for b in self.batches for e in b.events]


def wait_for(predicate: Any, within: float = 5.0, interval: float = 0.01) -> None:
    """Poll the relay's thread until predicate() holds (real sockets: nothing to drive)."""
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(interval)


def subscribed(pub: zmq.Socket[bytes], sink: ListSink) -> None:
    """Send sequence 0 until one arrives: a PUB socket drops messages until the
    subscription has reached it."""
    wait_for(lambda: sink.batches or send(pub, 0, 100), interval=0.02)


@pytest.fixture
def relay_and_pub() -> Any:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    relay = KVEventRelay(endpoint, topic="kv")
    sink = ListSink()
    relay.set_sink(sink)
    relay.start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(endpoint)  # as vLLM does with a concrete address
    yield relay, pub, sink
    pub.close(linger=0)
    ctx.term()
    relay.stop()


def send(pub: zmq.Socket[bytes], seq: int, *stored_hashes: int, topic: bytes = b"kv") -> None:
    batch = KVEventBatch(ts=0.0, events=[BlockStored([h], None, [h], 1, None, "GPU", None) for h in stored_hashes])
    pub.send_multipart([topic, seq.to_bytes(8, "big"), encode_batch(batch)])


def test_relay_delivers_in_order_skips_duplicates_and_clears_on_exit(relay_and_pub: Any) -> None:
    relay, pub, sink = relay_and_pub
    subscribed(pub, sink)
    wait_for(lambda: relay.batches >= 1)
    base = len(sink.batches)
    send(pub, 1, 1)
    send(pub, 1, 1)  # at-least-once: the same sequence again
    send(pub, 2, 2)
    send(pub, 0, 0, topic=b"other")  # not our topic
    wait_for(lambda: len(sink.batches) >= base + 2)
    relay.child_exited()
    wait_for(lambda: isinstance(sink.events()[-1], AllBlocksCleared))
    # Relayed under Meridian's hash of their tokens (rehash.py); the tokens tell them apart.
    stored = [e.token_ids[0] for e in sink.events() if isinstance(e, BlockStored) and e.token_ids[0] < 100]
    assert stored == [1, 2]
    assert sink.events()[-2].block_hashes == [hash_block(None, [2])]
    # The next process numbers from 0 again.
    send(pub, 0, 7)
    wait_for(lambda: any(isinstance(e, BlockStored) and e.token_ids == [7] for e in sink.events()))


def test_relay_counts_gaps_it_cannot_replay(relay_and_pub: Any) -> None:
    relay, pub, sink = relay_and_pub
    subscribed(pub, sink)
    send(pub, 1, 1)
    send(pub, 4, 4)
    wait_for(lambda: any(isinstance(e, BlockStored) and e.token_ids == [4] for e in sink.events()))
    assert relay.missed == 2
    # What the lost batches removed is unknown: consumers are told to forget the node's blocks.
    kinds = [type(e).__name__ for e in sink.events()]
    assert kinds[-2:] == ["AllBlocksCleared", "BlockStored"]


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 200.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 900.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 1.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 3.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 3.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 1.5
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql, chat",waiting_lora_adapters="law"} 1.8e+09
"""


def test_vllm_metrics_become_engine_stats() -> None:
    m = parse_vllm_metrics(METRICS)
    assert (m.running, m.waiting, m.kv_cache_usage) == (5, 4, 0.5)
    c = m.counters
    assert (c.prompt_tokens_total, c.generation_tokens_total) == (1000, 200)
    assert (c.prefix_cache_queries_total, c.prefix_cache_hits_total) == (900, 300)
    assert (c.requests_finished_total, c.requests_aborted_total, c.num_preemptions_total) == (10, 1, 1)
    # The newest lora_requests_info series wins.
    assert m.running_loras == ("chat", "sql") and m.waiting_loras == ("law",) and m.max_loras == 4


def test_older_metric_names_are_read_too() -> None:
    m = parse_vllm_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n'
                           'vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0\n'
                           'vllm:gpu_prefix_cache_hits_total{model_name="m"} 4.0\n')
    assert m.kv_cache_usage == 0.75
    assert (m.counters.prefix_cache_queries_total, m.counters.prefix_cache_hits_total) == (10, 4)


def test_counters_survive_a_vllm_restart() -> None:
    tracker = StatsTracker()
    tracker.update(1, parse_vllm_metrics(METRICS))
    tracker.child_exited()
    during = tracker.stats()
    assert (during.running, during.waiting, during.prompt_tokens_total) == (0, 0, 1000)
    tracker.update(2, parse_vllm_metrics('vllm:prompt_tokens_total{model_name="m"} 10.0\n'
                                         'vllm:num_requests_running{model_name="m"} 1.0\n'))
    after = tracker.stats()
    assert after.prompt_tokens_total == 1010 and after.generation_tokens_total == 200
    assert after.running == 1


def test_resident_adapters_are_the_most_recently_running_ones() -> None:
    tracker = StatsTracker()

    def scrape(running: str) -> str:
        return (f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{running}",'
                f'waiting_lora_adapters=""}} 1.0\n')

    for running in ("a", "b", "", "a", "c"):
        tracker.update(1, parse_vllm_metrics(scrape(running)))
    stats = tracker.stats()
    assert stats.loaded_loras == ("a", "c") and stats.running_loras == ("c",) and stats.max_loras == 2
    tracker.child_exited()
    assert tracker.stats().loaded_loras == ()


def test_dropping_metric_families_removes_all_their_lines() -> None:
    text = drop_metric_families(METRICS, ["vllm:num_requests_running", "vllm:prompt_tokens",
                                          "vllm:e2e_request_latency_seconds"])
    assert "vllm:num_requests_running" not in text
    assert "vllm:prompt_tokens" not in text
    assert "vllm:e2e_request_latency_seconds" not in text
    assert "vllm:num_requests_waiting{" in text and "# TYPE vllm:generation_tokens_total counter" in text
    assert parse_vllm_metrics(text).waiting == 4


def test_restart_backoff_doubles_up_to_the_cap_with_bounded_jitter() -> None:
    policy = RestartPolicy(backoff_s=1.0, backoff_max_s=10.0, jitter=0.2)
    assert [policy.delay(n, rand=lambda: 0.5) for n in (1, 2, 3, 4, 5, 6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert policy.delay(3, rand=lambda: 0.0) == pytest.approx(3.2)
    assert policy.delay(3, rand=lambda: 1.0) == pytest.approx(4.8)


def test_a_taken_event_port_fails_cleanly() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = KVEventRelay(endpoint)
    first.start()
    second = KVEventRelay(endpoint)
    with pytest.raises(zmq.ZMQError):
        second.start()
    second.stop()  # returns: nothing left open
    first.stop()
