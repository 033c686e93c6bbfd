"""A local fabric (control plane, router, three nodes) as real subprocesses on free ports."""

from collections.abc import Iterator

import pytest

from localfabric import FabricSpec, LocalFabric


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFabric]:
    spec = FabricSpec(
        work_dir=tmp_path_factory.mktemp("fabric"),
        heartbeat_interval_s=0.5,
        # Generous: a loaded CI machine must not see healthy nodes expire.
        node_ttl_s=6.0,
        drain_timeout_s=5.0,
        default_client_location="aws:us-east-1",
    )
    f = LocalFabric(spec)
    f.start()
    try:
        yield f
    finally:
        f.stop()
