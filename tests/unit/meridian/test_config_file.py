"""The YAML config file: every component reads its section, below flags and the environment,
and a file with an unknown key or a wrong type is refused with the key named."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from meridian import config_file
from meridian.settings import FileSettings, LogSettings, use_config_file
from meridian.settings.cli import CLISettings
from meridian.settings.control_plane import ControlPlaneSettings
from meridian.settings.node import NodeSettings, WeightSettings
from meridian.settings.providers import ProviderSettings
from meridian.settings.router import RouterSettings

TOKEN = "a-cluster-token-long-enough-to-pass-0123456789"


@pytest.fixture(autouse=True)
def _no_config_file(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("MERIDIAN_CONFIG", raising=False)
    monkeypatch.setenv("MERIDIAN_CLUSTER_TOKEN", TOKEN)
    yield
    use_config_file(None)


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "meridian.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# One non-default value per section, and how to read it back.
SECTION_VALUES: list[tuple[type[FileSettings], str, object]] = [
    (ControlPlaneSettings, "node_ttl_s", 42.0),
    (RouterSettings, "routing_policy", "least-load"),
    (NodeSettings, "max_num_seqs", 7),
    (WeightSettings, "concurrency", 3),
    (ProviderSettings, "aws_name_prefix", "acme"),
    (CLISettings, "timeout_s", 2.5),
    (LogSettings, "format", "json"),
]


@pytest.mark.parametrize(("cls", "key", "value"), SECTION_VALUES, ids=lambda v: getattr(v, "__name__", None))
def test_each_component_reads_its_own_section(tmp_path: Path, cls: type[FileSettings], key: str,
                                              value: object) -> None:
    default = getattr(cls(), key)
    # Every other section holds the same key with another value: only its own may apply.
    others = {c.config_section: {key: value} for c, _, _ in SECTION_VALUES
              if c is not cls and key in c.model_fields}
    use_config_file(write(tmp_path, {cls.config_section: {key: value}, **others}))
    assert getattr(cls(), key) == value != default


def test_a_node_reads_the_weights_section_for_its_weight_cache(tmp_path: Path) -> None:
    use_config_file(write(tmp_path, {"weights": {"cache_dir": "/srv/weights", "range_bytes": 8192}}))
    node = NodeSettings()
    assert node.weights.cache_dir == Path("/srv/weights") and node.weights.range_bytes == 8192


def test_flags_beat_environment_beats_file_beats_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_config_file(write(tmp_path, {"router": {"port": 9001, "host": "10.0.0.1", "max_attempts": 4}}))
    monkeypatch.setenv("MERIDIAN_ROUTER_HOST", "10.0.0.2")
    monkeypatch.setenv("MERIDIAN_ROUTER_MAX_ATTEMPTS", "5")
    s = RouterSettings(max_attempts=6)
    assert s.max_attempts == 6  # flag over environment over file
    assert s.host == "10.0.0.2"  # environment over file
    assert s.port == 9001  # file over default
    assert s.read_timeout_s == RouterSettings.model_fields["read_timeout_s"].default


def test_the_environment_names_the_file_when_no_flag_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_CONFIG", str(write(tmp_path, {"cli": {"control_plane_url": "http://cp:1"}})))
    assert CLISettings().control_plane_url == "http://cp:1"


def test_secrets_and_aliased_fields_are_read_by_their_field_name(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MERIDIAN_CLUSTER_TOKEN")
    monkeypatch.delenv("AWS_REGION", raising=False)
    use_config_file(write(tmp_path, {"router": {"cluster_token": TOKEN}, "weights": {"s3_region": "eu-west-1"}}))
    assert RouterSettings().cluster_token.get_secret_value() == TOKEN
    assert WeightSettings().s3_region == "eu-west-1"


def test_unknown_keys_and_sections_are_named_with_the_closest_known_one(tmp_path: Path) -> None:
    path = write(tmp_path, {"router": {"prot": 8080}, "nodes": {"port": 1}, "log": {"level": "INFO"}})
    with pytest.raises(config_file.ConfigFileError) as e:
        config_file.load(path)
    # Each with the line it is on (yaml.safe_dump writes router:, prot:, nodes:, port:, log:, …).
    assert e.value.problems[0] == "line 2: router.prot: unknown key (did you mean port?)"
    assert e.value.problems[1].startswith("line 3: nodes: unknown section (did you mean node?)")
    assert len(e.value.problems) == 2


def test_wrong_types_and_ranges_are_field_errors(tmp_path: Path) -> None:
    path = write(tmp_path, {"router": {"port": "eighty", "max_attempts": 99, "trusted_proxies": [1]},
                            "log": {"format": "xml"}})
    with pytest.raises(config_file.ConfigFileError) as e:
        config_file.load(path)
    assert [p.split(": ")[:2] for p in e.value.problems] == [
        ["line 2", "router.port"], ["line 3", "router.max_attempts"], ["line 5", "router.trusted_proxies[0]"],
        ["line 7", "log.format"]]
    assert "valid integer" in e.value.problems[0] and "less than or equal to 10" in e.value.problems[1]


def test_an_error_in_the_file_is_found_even_when_the_environment_overrides_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_ROUTER_PORT", "8080")
    with pytest.raises(config_file.ConfigFileError, match=r"router\.port"):
        config_file.load(write(tmp_path, {"router": {"port": -1}}))


def test_a_problem_in_a_hand_written_file_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "meridian.yaml"
    path.write_text("# the router\nrouter:\n  port: 8080\n\n  routing_polcy: nearest  # a typo\n")
    with pytest.raises(config_file.ConfigFileError) as e:
        config_file.load(path)
    assert e.value.problems == ["line 5: router.routing_polcy: unknown key (did you mean routing_policy?)"]
    path.write_text("router:\n  port: 8080\n  host: [unclosed\n")
    with pytest.raises(config_file.ConfigFileError) as e:
        config_file.load(path)
    [problem] = e.value.problems
    assert problem.startswith("not valid YAML: line 4, column 1: expected ',' or ']'")


@pytest.mark.parametrize(("text", "message"), [
    ("router: [1, 2\n", "not valid YAML"),
    ("- router\n", "top level must be a mapping"),
    ("router: 3\n", "router: must be a mapping"),
    ("node:\n  weights: {}\n", "top-level `weights:` section"),
])
def test_malformed_files_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(text)
    with pytest.raises(config_file.ConfigFileError, match=message):
        config_file.load(path)


def test_the_example_is_a_valid_file_that_names_every_setting() -> None:
    text = config_file.example()
    assert config_file.check(yaml.safe_load(text)) == []
    for section, cls in config_file.SECTIONS.items():
        assert f"\n{section}:\n" in text
        for name in cls.model_fields:
            if (section, name) != ("node", "weights"):
                assert f"  # {name}:" in text, (section, name)
    # The settings' own comments come along.
    assert "  # A node whose last heartbeat is older than this" in text
