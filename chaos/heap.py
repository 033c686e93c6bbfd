"""Keep the drill harness's garbage collector from pausing the fabric during the load.

The harness is part of the system under test's surroundings, not of the system: its event
loop sends the load and, in a local run, carries every byte between the routers and the
nodes through the fault proxies (chaos.faults.tcp_proxy). Whatever stops that loop is a
network outage nobody planned, and the routers react to it as they should: their probes
time out and a node is ejected, and a zoned tenant whose only node that was gets 503s.

CPython's full collection stops the whole process for as long as it takes to walk every
tracked object. A drill run on its own holds ~10^5 of them, but a test session that ran the
suite before the drills holds millions (~3.4 M once `pytest tests` has collected; a full
collection then takes 2-3 s on a 2-core CI machine): enough for two failed 1 s probes in a
row. `frozen_heap()` moves every object that exists when the load starts into the permanent
generation (`gc.freeze()`), so the collections during the load walk only what the run itself
allocated, and gives them back to the collector (`gc.unfreeze()`) when the load has ended.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """Objects alive on entry are left out of every collection until exit; yields how many.

    Not reentrant: an inner exit would unfreeze the outer run's heap (runs never nest).
    Garbage made inside is still collected; garbage alive on entry waits for the exit.
    """
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()
