"""History files: append-only JSON lines that survive a writer killed mid-line, and nothing worse."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.history import (
    ClientOp,
    History,
    HistoryError,
    HistoryWriter,
    Outcome,
    Routed,
    Served,
    read_records,
)

OP = ClientOp(
    key="k1", tenant="acme-eu", zone="eu", stream=True, invoke_s=1.0, first_byte_s=1.2, end_s=1.9,
    outcome=Outcome.FAIL, status=200, error_code="upstream_disconnected", region="gcp:europe-west4",
    node="n-eu-1", stream_error_event=True,
)


def test_records_round_trip_through_a_file(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    records = [OP, Routed("k1", "n-eu-1", "gcp:europe-west4", 1), Served("k1", "n-eu-1", completed=False),
               Served("k1", "n-eu-2", completed=True, prefill=True)]
    with HistoryWriter(path) as w:
        for r in records:
            w.append(r)
        # Flushed per line: a reader sees each record before the writer closes.
        assert read_records(path) == records
    assert read_records(path) == records
    assert isinstance(read_records(path)[0].outcome, Outcome)


def test_history_merges_client_router_and_node_logs(tmp_path: Path) -> None:
    files = {"client": [OP], "router": [Routed("k1", "n-eu-1", "gcp:europe-west4", 1)], "node": [Served("k1", "n-eu-1", True)]}
    for name, records in files.items():
        with HistoryWriter(tmp_path / f"{name}.jsonl") as w:
            for r in records:
                w.append(r)
    h = History.read(*(tmp_path / f"{n}.jsonl" for n in files))
    assert (h.client, h.routed, h.served) == (files["client"], files["router"], files["node"])


def test_a_torn_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    with HistoryWriter(path) as w:
        w.append(Served("k1", "n1", True))
    with path.open("ab") as f:
        f.write(b'{"type":"served","key":"k2","no')  # SIGKILL mid-write
    assert read_records(path) == [Served("k1", "n1", True)]


def test_a_torn_line_in_the_middle_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    path.write_bytes(b'{"type":"served","key":"k1","node":"n1","completed":true}\n{"type":"served","ke\n'
                     b'{"type":"served","key":"k3","node":"n1","completed":true}\n')
    with pytest.raises(HistoryError, match=r"h\.jsonl:2: not a history record"):
        read_records(path)


def test_a_complete_but_invalid_last_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    path.write_bytes(b'{"type":"served","key":"k1","node":"n1","completed":"maybe"}\n')
    with pytest.raises(HistoryError, match=r"h\.jsonl:1: .*completed"):
        read_records(path)


def test_appending_after_a_crash_drops_the_torn_tail_instead_of_corrupting_the_file(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    path.write_bytes(b'{"type":"served","key":"k1","node":"n1","completed":true}\n{"type":"ser')
    with HistoryWriter(path) as w:
        w.append(Served("k2", "n1", False))
    assert read_records(path) == [Served("k1", "n1", True), Served("k2", "n1", False)]
