"""A local fabric (control plane, router, three nodes) as real subprocesses on free ports."""

from collections.abc import Iterator

import pytest
from e2e_fabric import e2e_spec, running

from localfabric import LocalFabric


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFabric]:
    yield from running(e2e_spec(tmp_path_factory.mktemp("fabric"), default_client_location="aws:us-east-1"))
