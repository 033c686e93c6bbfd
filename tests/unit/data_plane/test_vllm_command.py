"""DeploymentSpec validation and the `vllm serve` command line built from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from data_plane.engine.vllm.command import (
    API_SERVER_MODULE,
    KVEventsEndpoints,
    NixlSideChannel,
    build_serve_argv,
    cpu_env,
    executable_argv,
    http_env,
    nixl_env,
    nixl_side_channel,
    spec_from_settings,
)
from data_plane.engine.vllm.spec import DeploymentSpec, DeploymentSpecError, load_deployment_spec
from meridian.contracts import KVConnector, KVTransferInfo, NodeRole
from meridian.http_server import CLIENT_KEEPALIVE_S
from meridian.settings.node import NodeSettings

MODEL_DIR = Path("/cache/models/llama-3.1-8b")
EVENTS = KVEventsEndpoints(
    endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558", topic="kv-events"
)


def spec(**fields: Any) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "chat", "model": "meta-llama/Llama-3.1-8B", **fields})


def flag(argv: list[str], name: str) -> str:
    """The value following `name` (which must appear exactly once)."""
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def test_minimal_spec_gives_the_full_managed_command() -> None:
    argv = build_serve_argv(spec(), model_dir=MODEL_DIR, gpu_count=1, port=8100, kv_events=EVENTS)
    assert argv == [
        "vllm", "serve", str(MODEL_DIR),
        "--served-model-name", "meta-llama/Llama-3.1-8B",
        "--host", "127.0.0.1", "--port", "8100",
        "--tensor-parallel-size", "1",
        "--dtype", "auto", "--load-format", "auto", "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
        "--enable-prefix-caching", "--enable-chunked-prefill",
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557",'
        '"topic":"kv-events","replay_endpoint":"tcp://127.0.0.1:5558"}',
    ]


CASES: list[tuple[str, dict[str, Any], int, dict[str, str], list[str]]] = [
    # id, spec fields, GPUs, expected flag values, flags that must be present
    ("tp-from-gpus", {}, 8, {"--tensor-parallel-size": "8"}, []),
    ("tp-and-pp", {"pipeline_parallel_size": 2}, 8,
     {"--tensor-parallel-size": "4", "--pipeline-parallel-size": "2"}, []),
    ("explicit-tp-replica-sized", {"tensor_parallel_size": 2}, 4, {"--tensor-parallel-size": "2"}, []),
    ("limits", {"max_model_len": 32768, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
                "gpu_memory_utilization": 0.85, "block_size": 32},
     4, {"--max-model-len": "32768", "--max-num-seqs": "64", "--max-num-batched-tokens": "2048",
         "--gpu-memory-utilization": "0.85", "--block-size": "32"}, []),
    ("quantized", {"quantization": "awq_marlin", "kv_cache_dtype": "fp8_e4m3", "dtype": "float16"},
     1, {"--quantization": "awq_marlin", "--kv-cache-dtype": "fp8_e4m3", "--dtype": "float16"}, []),
    ("served-name", {"served_model_name": "llama-8b", "load_format": "safetensors"}, 1,
     {"--served-model-name": "llama-8b", "--load-format": "safetensors"}, []),
    ("eager-and-extra", {"enforce_eager": True, "extra_args": ["--max-logprobs", "5"]}, 1,
     {"--max-logprobs": "5"}, ["--enforce-eager"]),
    ("prefix-and-chunked-off", {"enable_prefix_caching": False, "enable_chunked_prefill": False}, 1, {},
     ["--no-enable-prefix-caching", "--no-enable-chunked-prefill"]),
]


def test_no_kv_events_without_a_prefix_cache() -> None:
    argv = build_serve_argv(spec(enable_prefix_caching=False), model_dir=MODEL_DIR, gpu_count=1, port=1,
                            kv_events=EVENTS)
    assert "--kv-events-config" not in argv


@pytest.mark.parametrize(("fields", "gpus", "values", "present"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_spec_fields_become_flags(
    fields: dict[str, Any], gpus: int, values: dict[str, str], present: list[str]
) -> None:
    argv = build_serve_argv(spec(**fields), model_dir=MODEL_DIR, gpu_count=gpus, port=9000)
    for name, value in values.items():
        assert flag(argv, name) == value
    for name in present:
        assert name in argv
    # What the spec leaves at its default is not passed at all.
    if "quantization" not in fields:
        assert "--quantization" not in argv and "--kv-cache-dtype" not in argv
    if "max_model_len" not in fields:
        assert "--max-model-len" not in argv
    assert "--enable-lora" not in argv and "--speculative-config" not in argv


def test_lora_adapters_become_one_lora_modules_flag(tmp_path: Path) -> None:
    odd = tmp_path / "with=sign"
    s = spec(loras=[{"name": "sql"}, {"name": "chat", "source": "s3://bucket/chat"}, {"name": "odd"}],
             max_loras=2, max_lora_rank=64, max_cpu_loras=8)
    argv = build_serve_argv(s, model_dir=MODEL_DIR, gpu_count=1, port=9000,
                            lora_paths={"sql": Path("/lora/sql"), "chat": Path("/lora/chat"), "odd": odd})
    assert "--enable-lora" in argv
    assert flag(argv, "--max-loras") == "2"
    assert flag(argv, "--max-lora-rank") == "64"
    assert flag(argv, "--max-cpu-loras") == "8"
    start = argv.index("--lora-modules") + 1
    assert argv[start:start + 2] == ["sql=/lora/sql", "chat=/lora/chat"]
    # vLLM splits name=path on every '=', so such a path goes as JSON.
    assert json.loads(argv[start + 2]) == {"name": "odd", "path": str(odd)}


def test_a_lora_adapter_without_a_local_directory_is_an_error() -> None:
    s = spec(loras=[{"name": "sql"}, {"name": "chat"}])
    with pytest.raises(DeploymentSpecError, match="chat"):
        build_serve_argv(s, model_dir=MODEL_DIR, gpu_count=1, port=9000, lora_paths={"sql": Path("/l")})


@pytest.mark.parametrize(
    ("speculative", "draft_dir", "expected"),
    [
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2},
         None,
         {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
        ({"method": "eagle3", "num_speculative_tokens": 3, "model": "yuhuili/EAGLE3-LLaMA3.1-8B",
          "draft_tensor_parallel_size": 1},
         Path("/cache/eagle3"),
         {"method": "eagle3", "num_speculative_tokens": 3, "model": "/cache/eagle3",
          "draft_tensor_parallel_size": 1}),
        ({"method": "mtp", "num_speculative_tokens": 1}, None, {"method": "mtp", "num_speculative_tokens": 1}),
    ],
    ids=["ngram", "eagle3-local-draft", "mtp"],
)
def test_speculative_config_json(speculative: dict[str, Any], draft_dir: Path | None,
                                 expected: dict[str, Any]) -> None:
    argv = build_serve_argv(spec(speculative=speculative), model_dir=MODEL_DIR, gpu_count=1, port=9000,
                            draft_model_dir=draft_dir)
    assert json.loads(flag(argv, "--speculative-config")) == expected


def test_draft_weights_must_be_local() -> None:
    s = spec(speculative={"method": "eagle", "num_speculative_tokens": 2, "model": "org/eagle"})
    with pytest.raises(DeploymentSpecError, match="draft model"):
        build_serve_argv(s, model_dir=MODEL_DIR, gpu_count=1, port=9000)


@pytest.mark.parametrize(
    ("fields", "gpus", "message"),
    [
        ({"tensor_parallel_size": 8}, 4, "needs 8 GPUs; this node has 4"),
        ({"tensor_parallel_size": 3}, 4, "does not divide the node's 4 GPUs"),
        ({"pipeline_parallel_size": 3}, 4, "pipeline_parallel_size 3 does not divide"),
        ({"tensor_parallel_size": 2}, 0, "parallelism needs GPUs; this node has none"),
        ({"speculative": {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}},
         4, "draft_tensor_parallel_size must be 1 or"),
    ],
)
def test_parallelism_must_fit_the_node(fields: dict[str, Any], gpus: int, message: str) -> None:
    with pytest.raises(DeploymentSpecError, match=message):
        build_serve_argv(spec(**fields), model_dir=MODEL_DIR, gpu_count=gpus, port=9000)


def test_a_node_without_gpus_runs_vllms_cpu_build_with_its_kv_cache_in_host_memory() -> None:
    s = spec(cpu_kvcache_space_gib=2, cpu_threads_bind="nobind", env={"VLLM_CPU_KVCACHE_SPACE": "3"})
    argv = build_serve_argv(s, model_dir=MODEL_DIR, gpu_count=0, port=9000, executable="auto")
    # The server module works for the `vllm-cpu` distribution, whose `vllm` script does not.
    assert argv[1:4] == ["-m", API_SERVER_MODULE, "--model"] and argv[4] == str(MODEL_DIR)
    assert flag(argv, "--tensor-parallel-size") == "1"
    assert "--gpu-memory-utilization" not in argv
    # The spec's own env wins over the sizes derived from its fields.
    assert cpu_env(s) == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert cpu_env(spec()) == {"VLLM_CPU_KVCACHE_SPACE": "4"}


def test_tensor_parallelism_must_divide_the_attention_heads(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 6}))
    with pytest.raises(DeploymentSpecError, match="6 attention heads"):
        build_serve_argv(spec(), model_dir=tmp_path, gpu_count=4, port=9000)
    argv = build_serve_argv(spec(), model_dir=tmp_path, gpu_count=2, port=9000)
    assert flag(argv, "--tensor-parallel-size") == "2"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"quantization": "awk"}, "unknown quantization 'awk'"),
        ({"kv_cache_dtype": "int4"}, "unknown kv_cache_dtype"),
        ({"load_format": "zip"}, "unknown load_format"),
        ({"max_lora_rank": 48}, "max_lora_rank"),
        ({"block_size": 24}, "block_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"extra_args": ["--port", "1"]}, "may not set --port"),
        ({"extra_args": ["--kv-events-config={}"]}, "may not set --kv-events-config"),
        ({"loras": [{"name": "a"}, {"name": "a"}]}, "repeated: a"),
        ({"loras": [{"name": "bad name"}]}, "name"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
        ({"speculative": {"method": "eagle", "num_speculative_tokens": 2}}, "needs `model`"),
        ({"speculative": {"method": "ngram", "num_speculative_tokens": 2, "model": "x"}}, "takes no draft"),
        ({"speculative": {"method": "ngram", "num_speculative_tokens": 2,
                          "prompt_lookup_min": 5, "prompt_lookup_max": 2}}, "must not exceed"),
        ({"speculative": {"method": "medusa2", "num_speculative_tokens": 2}}, "method"),
        ({"env": {"1BAD": "x"}}, "environment variable"),
        ({"max_model_len": 8192, "enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
         "without chunked prefill"),
        ({"surprise": True}, "surprise"),
    ],
)
def test_invalid_specs_are_rejected_with_a_clear_message(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(**fields)


def test_spec_files_in_json_and_yaml(tmp_path: Path) -> None:
    data = {"name": "chat", "model": "llama", "max_model_len": 4096, "loras": [{"name": "sql"}]}
    (tmp_path / "spec.json").write_text(json.dumps(data))
    (tmp_path / "spec.yaml").write_text("name: chat\nmodel: llama\nmax_model_len: 4096\nloras:\n  - name: sql\n")
    loaded = load_deployment_spec(tmp_path / "spec.yaml")
    assert loaded == load_deployment_spec(tmp_path / "spec.json")
    assert loaded.max_model_len == 4096 and [lora.name for lora in loaded.loras] == ["sql"]


def test_a_node_without_a_spec_derives_one_from_its_settings(tmp_path: Path) -> None:
    (tmp_path / "loras" / "sql").mkdir(parents=True)
    settings = NodeSettings(model_dir=tmp_path / "my-model", max_model_len=4096, lora_dir=tmp_path / "loras",
                            lora_modules={"chat": tmp_path / "chat"}, max_lora_rank=32)
    derived = spec_from_settings(settings)
    assert derived.served_name == "my-model"
    assert derived.max_model_len == 4096
    assert [lora.name for lora in derived.loras] == ["chat", "sql"]
    assert derived.max_lora_rank == 32
    # The torch engine's CPU-sized defaults do not leak into a GPU deployment.
    assert derived.max_num_seqs == 256 and derived.dtype == "auto"


def test_executable_setting_accepts_a_command_line_or_a_list() -> None:
    assert executable_argv("python -m vllm.entrypoints.cli.main") == [
        "python", "-m", "vllm.entrypoints.cli.main"]
    assert executable_argv(["/usr/bin/python3", "/opt/standin.py"]) == ["/usr/bin/python3", "/opt/standin.py"]
    argv = build_serve_argv(spec(), model_dir=MODEL_DIR, gpu_count=1, port=1, executable=["py", "s.py"])
    assert argv[:4] == ["py", "s.py", "serve", str(MODEL_DIR)]


# --- prefill/decode: vLLM's NixlConnector ---------------------------------------------------

def nixl_settings(**fields: Any) -> NodeSettings:
    return NodeSettings(engine="vllm", model_dir=MODEL_DIR, **fields)


def kv_transfer_config(argv: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(flag(argv, "--kv-transfer-config"))
    return config


def test_a_prefill_node_without_gpus_runs_nixl_over_host_memory_with_its_side_channel() -> None:
    side = nixl_side_channel(nixl_settings(role="prefill", kv_side_channel_port=5601, kv_lease_s=12.5), "10.0.0.7")
    assert side == NixlSideChannel(role=NodeRole.PREFILL, host="10.0.0.7", port=5601, lease_s=12.5)
    argv = build_serve_argv(spec(), model_dir=MODEL_DIR, gpu_count=0, port=9000, kv_transfer=side)
    # vLLM reads the lease in whole seconds: rounded up, never cut short.
    assert kv_transfer_config(argv) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 13}}
    assert nixl_env(side) == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.7", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
                              "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "13"}
    # What the node registers: peers reach the side channel on the advertised host.
    assert side.info() == KVTransferInfo(connector=KVConnector.NIXL, endpoint="10.0.0.7:5601", lease_s=12.5)


def test_a_decode_node_with_gpus_keeps_its_kv_on_the_gpu() -> None:
    side = nixl_side_channel(nixl_settings(role="decode", kv_side_channel_port=5602), "fd00::7")
    assert side is not None
    config = kv_transfer_config(build_serve_argv(spec(), model_dir=MODEL_DIR, gpu_count=2, port=9000,
                                                 kv_transfer=side))
    assert (config["kv_role"], config["kv_buffer_device"]) == ("kv_consumer", "cuda")
    assert config["kv_connector_extra_config"] == {"kv_lease_duration": 60}
    assert side.info().endpoint == "[fd00::7]:5602"


def test_a_co_located_node_runs_no_connector_unless_it_names_nixl() -> None:
    assert nixl_side_channel(nixl_settings(), "10.0.0.7") is None
    assert nixl_env(None) == {}
    assert "--kv-transfer-config" not in build_serve_argv(spec(), model_dir=MODEL_DIR, gpu_count=0, port=9000)
    side = nixl_side_channel(nixl_settings(kv_connector="NixlConnector"), "127.0.0.1")
    assert side is not None and side.role is NodeRole.BOTH
    # Port 0: a free port, picked once so that the node registers it and vLLM keeps it.
    assert side.port > 0
    config = kv_transfer_config(build_serve_argv(spec(), model_dir=MODEL_DIR, gpu_count=0, port=9000,
                                                 kv_transfer=side))
    assert config["kv_role"] == "kv_both"


def test_a_vllm_node_refuses_the_torch_engines_connector_and_a_second_one_from_its_spec() -> None:
    with pytest.raises(DeploymentSpecError, match="MeridianConnector is the torch engine's"):
        nixl_side_channel(nixl_settings(role="prefill", kv_connector="MeridianConnector"), "127.0.0.1")
    side = NixlSideChannel(role=NodeRole.DECODE, host="127.0.0.1", port=5602, lease_s=60)
    own = spec(extra_args=["--kv-transfer-config={\"kv_connector\":\"LMCacheConnectorV1\"}"])
    with pytest.raises(DeploymentSpecError, match="decode node sets --kv-transfer-config itself"):
        build_serve_argv(own, model_dir=MODEL_DIR, gpu_count=0, port=9000, kv_transfer=side)
    # A co-located node leaves the spec's own connector alone.
    assert "--kv-transfer-config=" in build_serve_argv(own, model_dir=MODEL_DIR, gpu_count=0, port=9000)[-1]


def test_vllm_keeps_an_idle_connection_longer_than_the_node_pools_it() -> None:
    # At vLLM's default (5 s, httpx's too) a request on a connection idle for just under
    # 5 s could cross vLLM's close and fail unread.
    assert int(http_env()["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) >= 2 * CLIENT_KEEPALIVE_S
