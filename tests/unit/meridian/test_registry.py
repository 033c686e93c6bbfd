"""The one registry: lazy built-ins, registration, copies, and one UnknownName error."""

from __future__ import annotations

import sys

import pytest

from meridian.registry import Registry, UnknownName, load_target


def test_builtins_load_on_first_use_only() -> None:
    sys.modules.pop("colorsys", None)
    reg: Registry[object] = Registry("converter", builtins={"hls": "colorsys:rgb_to_hls"})
    assert "hls" in reg and reg.names() == ["hls"]
    assert "colorsys" not in sys.modules
    import colorsys

    assert reg.get("hls") is colorsys.rgb_to_hls


def test_unknown_names_list_the_known_ones() -> None:
    reg: Registry[int] = Registry("widget")
    reg.register("b", 2)
    reg.register_as("a")(1)
    with pytest.raises(UnknownName) as err:
        reg.get("c")
    assert str(err.value) == "unknown widget 'c'; known: a, b"
    assert isinstance(err.value, LookupError)
    assert err.value.known == ["a", "b"]
    assert str(UnknownName("widget", "x", [])) == "unknown widget 'x'; known: none"


def test_copies_are_independent() -> None:
    reg: Registry[int] = Registry("widget")
    reg.register("a", 1)
    mine = reg.copy()
    mine.register("b", 2)
    mine.unregister("a")
    assert reg.names() == ["a"] and mine.names() == ["b"] and len(mine) == 1 and list(mine) == ["b"]


def test_bad_targets_and_names_are_refused() -> None:
    with pytest.raises(ValueError):
        load_target("no-colon")
    with pytest.raises(ValueError):
        Registry("widget").register("", 1)
    assert load_target("os.path:join.__name__") == "join"
