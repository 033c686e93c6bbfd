"""bench.gpu_kit's choice of wheels: Meridian's base install, extras followed and the dev extra
left out, less what the GPU machine's image has, never torch, always protobuf and grpcio."""

from __future__ import annotations

from pathlib import Path

from bench.gpu_kit import IMAGE, closure, download_command, read_have, to_carry

FAKE = {
    "meridian": ("0.1.0", ["pydantic>=2", "uvicorn[standard]>=0.30", "torch>=2.3", "protobuf>=7.35",
                           "pytest>=8; extra == 'dev'"]),
    "pydantic": ("2.14.4", ["pydantic-core==2.50.5", "typing-extensions>=4"]),
    "pydantic-core": ("2.50.5", ["typing-extensions>=4"]),
    "typing-extensions": ("4.16.0", []),
    "uvicorn": ("0.54.0", ["h11>=0.8", "uvloop>=0.15; extra == 'standard' and sys_platform != 'win32'",
                           "httptools>=0.6; extra == 'standard'"]),
    "h11": ("0.16.0", []),
    "uvloop": ("0.23.0", []),
    "httptools": ("0.9.0", []),
    "torch": ("2.13.0+cpu", ["sympy>=1"]),
    "sympy": ("1.14.0", []),
    "protobuf": ("7.36.2", []),
    "pytest": ("9.2.0", []),
}


def fake(name: str) -> tuple[str, list[str]] | None:
    return FAKE.get(name.lower().replace("_", "-"))


def test_the_closure_follows_the_extras_asked_for_and_leaves_the_dev_extra_out() -> None:
    found = closure("meridian", fake)
    assert found["httptools"] == "0.9.0" and "uvloop" in found  # uvicorn[standard]
    assert "pytest" not in found  # meridian[dev]
    assert found["pydantic-core"] == "2.50.5"


def test_what_the_image_has_stays_behind_but_torch_never_travels_and_protobuf_always_does() -> None:
    carry = to_carry(closure("meridian", fake), ["typing_extensions", "uvloop", "protobuf", "h11", "sympy"])
    assert carry == {"httptools": "0.9.0", "protobuf": "7.36.2", "pydantic": "2.14.4", "pydantic-core": "2.50.5",
                     "uvicorn": "0.54.0"}


def test_the_h200_images_list_is_read_and_the_real_base_install_travels_light(tmp_path: Path) -> None:
    have = read_have(IMAGE)
    assert "torch" in have and "numpy" in have and not any(n.startswith("#") for n in have)
    # This venv's base install, as the kit would carry it: the packages the image lacks.
    carry = to_carry(closure("meridian"), have)
    assert {"pydantic", "fastapi", "sqlalchemy", "grpcio", "protobuf"} <= carry.keys()
    assert not {"torch", "numpy", "pytest", "openai", "meridian"} & carry.keys()
    command = download_command(carry, tmp_path, "3.12")
    assert command[command.index("--python-version") + 1] == "3.12" and "--no-deps" in command
    assert f"pydantic=={carry['pydantic']}" in command
