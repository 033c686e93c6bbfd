"""What a DeploymentSpec's extra arguments tell routers: the node's tool-call parser."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from data_plane.engine.vllm.spec import DeploymentSpec, tool_call_parser

ON = "--enable-auto-tool-choice"


@pytest.mark.parametrize(("args", "expected"), [
    ([ON, "--tool-call-parser", "pythonic"], "pythonic"),
    (["--tool-call-parser=hermes", ON], "hermes"),
    (["--enable_auto_tool_choice", "--tool_call_parser", "llama3_json"], "llama3_json"),  # vLLM's own spelling
    ([ON, "--tool-call-parser", "hermes", "--tool-call-parser=pythonic"], "pythonic"),  # the last one wins
    (["--max-log-len", "10", ON, "--tool-call-parser", "granite-20b-fc", "--enforce-eager"], "granite-20b-fc"),
    # Without auto tool choice vLLM reads no tool calls from the text, whatever the parser.
    (["--tool-call-parser", "pythonic"], None),
    ([ON, "--tool-call-parser", "pythonic", "--no-enable-auto-tool-choice"], None),
    ([ON], None),  # vLLM refuses to start like this
    ([ON, "--tool-call-parser"], None),
    ([], None),
    # A flag that only starts like it is another flag; a flag is not a value.
    ([ON, "--tool-call-parser-plugin", "p.py"], None),
    ([ON, "--tool-call-parser", "--enforce-eager"], None),
])
def test_the_tool_call_parser_is_read_from_the_arguments(args: list[str], expected: str | None) -> None:
    assert tool_call_parser(args) == expected


def test_a_spec_names_its_parser() -> None:
    assert DeploymentSpec(name="d", model="m", extra_args=[ON, "--tool-call-parser", "pythonic"]) \
        .tool_call_parser == "pythonic"
    assert DeploymentSpec(name="d", model="m").tool_call_parser is None


@pytest.mark.parametrize("parser", ["py thonic", "../parsers/x", "x" * 65, "pythonic\n"])
def test_a_parser_name_routers_would_refuse_is_refused_in_the_spec(parser: str) -> None:
    with pytest.raises(ValidationError, match="not a parser name"):
        DeploymentSpec(name="d", model="m", extra_args=[ON, f"--tool-call-parser={parser}"])
