"""`meridian deploy -f spec.yaml`: the model's shape read from its checkpoint (a directory, or a
weight URI of which only config.json and the safetensors headers are read), the deployment PUT,
`--dry-run` sending nothing, and every bad spec refused with its field named."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from cli.checkpoint_shape import CheckpointShapeError, shape_fields, shape_from_dir
from cli.main import app
from data_plane.model.make_tiny import make_tiny_checkpoint
from meridian.contracts import DeploymentView
from meridian.ports import free_port

runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", seed=0)


def parameters(checkpoint: Path) -> int:
    """Every tensor's elements, read with the safetensors library itself."""
    total = 0
    for f in checkpoint.glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            total += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())  # noqa: SIM118
    return total


@pytest.fixture(scope="module")
def sharded(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint split over two safetensors files with an index, as large models come."""
    out = tmp_path_factory.mktemp("sharded") / "tiny-sharded"
    shutil.copytree(checkpoint, out)
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(out / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def write_spec(tmp_path: Path, spec: dict, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(spec) if name.endswith(".json") else yaml.safe_dump(spec))
    return path


def test_a_checkpoint_directory_gives_the_models_shape(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    fields = shape_from_dir(checkpoint)
    assert fields["layers"] == config["num_hidden_layers"]
    assert fields["kv_heads"] == config["num_key_value_heads"]
    assert fields["head_dim"] == config["hidden_size"] // config["num_attention_heads"]
    assert fields["attention_heads"] == config["num_attention_heads"]
    assert fields["max_context"] == config["max_position_embeddings"]
    assert round(fields["params_b"] * 1e9) == parameters(checkpoint)


def test_without_safetensors_the_parameters_are_estimated_from_the_config():
    # Llama 3 8B's config: 8.03 B parameters.
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "bfloat16",
              "max_position_embeddings": 131072}
    fields = shape_fields(config, None)
    assert fields["params_b"] == pytest.approx(8.03, abs=0.01)
    assert (fields["head_dim"], fields["kv_heads"], fields["quantization"]) == (128, 8, "bf16")
    with pytest.raises(CheckpointShapeError, match="num_hidden_layers"):
        shape_fields({"hidden_size": 8}, None)


def test_deploy_from_a_directory_registers_the_model_and_its_deployment(admin_env, checkpoint, tmp_path):
    spec = write_spec(tmp_path, {"name": "tiny-dir", "model": {"path": str(checkpoint), "max_context": 1024},
                                 "zone": "eu", "min_replicas": 0, "max_replicas": 2,
                                 "placement": {"min_regions": 1, "min_providers": 1}})
    r = runner.invoke(app, ["deploy", "-f", str(spec), "-o", "json"], env=admin_env)
    assert r.exit_code == 0, r.output
    d = DeploymentView.model_validate_json(r.stdout)
    assert (d.model, d.zone, d.max_replicas, d.placement.min_regions) == ("tiny-dir", "eu", 2, 1)
    assert "model tiny-dir:" in r.stderr and "2 layers" in r.stderr
    models = {m["name"]: m for m in json.loads(runner.invoke(app, ["models", "-o", "json"], env=admin_env).stdout)}
    m = models["tiny-dir"]
    assert (m["layers"], m["kv_heads"], m["head_dim"], m["max_context"]) == (2, 2, 16, 1024)
    assert round(m["params_b"] * 1e9) == parameters(checkpoint)
    r = runner.invoke(app, ["deployments", "list"], env=admin_env)
    assert "tiny-dir" in r.stdout and "0–2" in r.stdout
    r = runner.invoke(app, ["models"], env=admin_env)
    line = next(line for line in r.stdout.splitlines() if "tiny-dir" in line)
    assert "1,024" in line


def test_deploy_from_a_weight_uri_reads_only_config_and_headers(admin_env, checkpoint, tmp_path):
    origin = tmp_path / "origin"
    assert runner.invoke(app, ["model", "push", str(checkpoint), f"file://{origin}", "--zone", "eu"]).exit_code == 0
    spec = write_spec(tmp_path, {"name": "tiny-uri", "model": {"uri": f"file://{origin}"}, "zone": "eu"}, "d.json")
    r = runner.invoke(app, ["deploy", "-f", str(spec)], env=admin_env)
    assert r.exit_code == 0, r.output
    assert "tiny-uri" in r.stdout and "Deployments" in r.stdout
    models = {m["name"]: m for m in json.loads(runner.invoke(app, ["models", "-o", "json"], env=admin_env).stdout)}
    assert models["tiny-uri"]["weights_uri"] == f"file://{origin}"
    assert round(models["tiny-uri"]["params_b"] * 1e9) == parameters(checkpoint)


def test_a_sharded_checkpoint_at_a_uri_is_read_through_its_index(checkpoint, sharded, tmp_path):
    origin = tmp_path / "origin"
    assert runner.invoke(app, ["model", "push", str(sharded), f"file://{origin}"]).exit_code == 0
    for source in ({"uri": f"file://{origin}"}, {"path": str(sharded)}):
        spec = write_spec(tmp_path, {"name": "tiny-sharded", "model": source})
        r = runner.invoke(app, ["deploy", "-f", str(spec), "--dry-run"])
        assert r.exit_code == 0, r.output
        model = json.loads(r.stdout)["PUT /v1/deployments/tiny-sharded"]["model"]
        assert round(model["params_b"] * 1e9) == parameters(checkpoint) == parameters(sharded)


def test_dry_run_prints_the_body_and_sends_nothing(checkpoint, tmp_path):
    spec = write_spec(tmp_path, {"name": "org/tiny", "model": {"path": str(checkpoint)}, "zone": "us"})
    env = {"MERIDIAN_CONTROL_PLANE_URL": f"http://127.0.0.1:{free_port()}", "MERIDIAN_API_KEY": "k"}
    r = runner.invoke(app, ["deploy", "-f", str(spec), "--dry-run"], env=env)
    assert r.exit_code == 0, r.output
    bodies = json.loads(r.stdout)
    # One request: the deployment and, in its body, the model (one transaction on the control plane).
    [body] = bodies.values()
    assert list(bodies) == ["PUT /v1/deployments/org/tiny"]
    assert body["zone"] == "us" and body["model"]["layers"] == 2
    r = runner.invoke(app, ["deploy", "-f", str(spec), "--dry-run", "-o", "yaml"], env=env)
    assert yaml.safe_load(r.stdout) == bodies


def test_a_deployment_spec_without_a_model_deploys_a_registered_one(admin_env, tmp_path):
    spec = write_spec(tmp_path, {"name": "tiny-dir", "zone": "eu", "max_replicas": 3})
    r = runner.invoke(app, ["deploy", "-f", str(spec), "-o", "json"], env=admin_env)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["max_replicas"] == 3


@pytest.mark.parametrize(("spec", "expected"), [
    ({"zone": "eu"}, ["is not a valid deployment spec:", "  name: Field required"]),
    # yaml.safe_dump sorts the keys: the lines below are those of the file it writes.
    ({"name": "m", "model": {"path": "/x", "uri": "s3://b/m"}}, ["  line 1: model: Value error, give the checkpoint's"]),
    ({"name": "m", "model": {"uri": "ftp://b/m"}}, ["  line 2: model.uri: String should match pattern"]),
    ({"name": "m", "model": {"path": "/nonexistent"}}, ["model: /nonexistent is not a directory"]),
    ({"name": "m", "zone": "EU", "max_replicas": 0},
     ["is not a valid deployment spec:", "  line 3: zone: String should match",
      "  line 1: max_replicas: Input should be"]),
    ({"name": "m", "model": {"params_b": 1, "layers": 1, "kv_heads": 3, "head_dim": 8, "attention_heads": 4}},
     ["  line 1: model: Value error, attention_heads must be a multiple of kv_heads"]),
])
def test_a_bad_spec_is_refused_with_its_fields_named(tmp_path, spec, expected):
    r = runner.invoke(app, ["deploy", "-f", str(write_spec(tmp_path, spec)), "--dry-run"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.stdout == ""
    for text in expected:
        assert text in r.stderr, r.stderr


def test_a_spec_that_is_not_a_checkpoint_or_not_yaml_is_one_line(tmp_path):
    (tmp_path / "ckpt").mkdir()
    r = runner.invoke(app, ["deploy", "-f", str(write_spec(tmp_path, {"name": "m", "model": {"path": "ckpt"}}))])
    assert r.exit_code == 2 and "model: " in r.stderr and "has no config.json" in r.stderr
    (tmp_path / "bad.yaml").write_text("name: m\nzone: eu\nplacement: {min_regions: 1\n")
    r = runner.invoke(app, ["deploy", "-f", str(tmp_path / "bad.yaml")], env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert " is not YAML or JSON: line 4, column 1: expected ',' or '}'" in r.stderr
    (tmp_path / "list.yaml").write_text("- a\n")
    r = runner.invoke(app, ["deploy", "-f", str(tmp_path / "list.yaml")])
    assert r.exit_code == 2 and "a deployment spec is a mapping" in r.stderr
    r = runner.invoke(app, ["deploy", "-f", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "cannot read" in r.stderr


def test_a_refused_deployment_leaves_no_model_behind(admin_env, checkpoint, tmp_path):
    for name, fields in (("tiny-bad-zone", {"zone": "mars"}),
                         ("tiny-bad-region", {"placement": {"replicas": {"aws:atlantis-1": 1}}})):
        spec = write_spec(tmp_path, {"name": name, "model": {"path": str(checkpoint)}, **fields})
        r = runner.invoke(app, ["deploy", "-f", str(spec)], env=admin_env)
        assert r.exit_code == 1 and "Traceback" not in r.output and r.stdout == ""
        assert r.stderr.startswith("400 Bad Request: ") and len(r.stderr.strip().splitlines()) == 1
        models = json.loads(runner.invoke(app, ["models", "-o", "json"], env=admin_env).stdout)
        assert name not in {m["name"] for m in models}
    assert "unknown zone 'mars'" in runner.invoke(
        app, ["deploy", "-f", str(write_spec(tmp_path, {"name": "x", "zone": "mars"}))], env=admin_env).stderr


def test_a_misspelt_key_in_a_spec_names_its_line_and_the_key_meant(checkpoint, tmp_path):
    spec = tmp_path / "llama.yaml"
    spec.write_text(f"""name: tiny
model:
  path: {checkpoint}
  quantisation: fp8
zone: eu
max_replica: 2
placement:
  min_region: 1
autoscale: {{target_concurrency: 4}}
""")
    r = runner.invoke(app, ["deploy", "-f", str(spec), "--dry-run"], env={"COLUMNS": "300"})
    assert r.exit_code == 2 and r.stdout == ""
    # Every problem at once, each on the line the file has it.
    assert r.stderr.splitlines()[1:] == [
        "  line 4: model.quantisation: unknown field (did you mean quantization?)",
        "  line 6: max_replica: unknown field (did you mean max_replicas?)",
        "  line 8: placement.min_region: unknown field (did you mean min_regions?)",
        "  line 9: autoscale: unknown field (did you mean autoscaling?)"]
    spec.write_text(spec.read_text().replace("max_replica:", "max_replicas:").replace("min_region:", "min_regions:")
                    .replace("autoscale:", "autoscaling:").replace("quantisation", "quantization"))
    r = runner.invoke(app, ["deploy", "-f", str(spec), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["PUT /v1/deployments/tiny"]["model"]["quantization"] == "fp8"
