"""`serve` runs the control plane under uvicorn and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
from alembic.script import ScriptDirectory
from cp_harness import CLUSTER_TOKEN, spawn_control_plane, stop_process, wait_until_up

from control_plane.db import migrate
from meridian.ports import free_port


def test_serve_migrates_answers_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 'cp.db'}"
    proc = spawn_control_plane(port, db_url)
    try:
        wait_until_up(proc, port)
        r = httpx.get(
            f"http://127.0.0.1:{port}/v1/routing-table",
            headers={"authorization": f"Bearer {CLUSTER_TOKEN}"},
            timeout=2,
        )
        assert r.status_code == 200
        assert r.headers["etag"] == '"0"'
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        stop_process(proc)
    # Migrated to the newest revision, whichever that is.
    assert migrate.current(db_url) == ScriptDirectory.from_config(migrate.alembic_config(db_url)).get_current_head()


def test_an_open_long_poll_does_not_hold_up_shutdown(tmp_path: Path) -> None:
    """Every demo stop logged `ERROR: Cancel 1 running task(s), timeout graceful shutdown
    exceeded` and a traceback: a router's routing-table long-poll held the shutdown until
    uvicorn cancelled it. Shutdown now answers it at once."""
    import threading
    import time

    from control_plane.app import GRACEFUL_SHUTDOWN_S

    port = free_port()
    proc = spawn_control_plane(port, f"sqlite:///{tmp_path / 'cp.db'}")
    answers: list[int] = []
    try:
        wait_until_up(proc, port)

        def long_poll() -> None:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/routing-table", params={"wait": 30},
                          headers={"authorization": f"Bearer {CLUSTER_TOKEN}", "if-none-match": '"0"'},
                          timeout=40)
            answers.append(r.status_code)

        poller = threading.Thread(target=long_poll)
        poller.start()
        time.sleep(0.5)  # the poll is waiting on the version
        assert not answers
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=GRACEFUL_SHUTDOWN_S + 5) == 0
        took = time.monotonic() - stopped_at
        poller.join(timeout=5)
    finally:
        stop_process(proc)
    assert answers == [304]  # answered: nothing changed
    assert took < GRACEFUL_SHUTDOWN_S
    output = proc.stdout.read().decode() if proc.stdout else ""
    assert "ERROR" not in output and "Traceback" not in output, output
