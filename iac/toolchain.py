"""What `meridian iac synth` and `diff` need besides a plan, checked before any work starts.

cdktf's Python packages are the `iac` extra, which `make demo`'s venv leaves out; the provider
bindings run on jsii, which starts a Node.js process. Without either, synth used to fail a
minute in with `No module named 'cdktf'` or `[Errno 2] No such file or directory` and a
traceback; here each is one line that says what to install. The check imports nothing of
cdktf (importing it starts jsii).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess

# The oldest Node.js major that jsii 1.x (cdktf 0.21) still runs on; older ones fail inside it.
MIN_NODE_MAJOR = 18
IAC_MODULES = (
    "cdktf",
    "constructs",
    "cdktf_cdktf_provider_aws",
    "cdktf_cdktf_provider_google",
    "cdktf_cdktf_provider_kubernetes",
)
NODE_INSTALL_HINT = (
    "install Node.js (https://nodejs.org/en/download, or `apt-get install nodejs` on Debian 12+) "
    "and put `node` on PATH"
)


class ToolchainError(Exception):
    """Something `meridian iac` needs is missing; the message says what to install."""


def missing_modules() -> list[str]:
    """The cdktf packages this Python cannot import (find_spec only: nothing is imported)."""
    return [name for name in IAC_MODULES if importlib.util.find_spec(name) is None]


def node_major(node: str) -> int | None:
    """The major version `node --version` reports (v20.11.1 -> 20); None if it does not say."""
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.match(r"v?(\d+)\.", out.stdout.strip())
    return int(m.group(1)) if m else None


def check_toolchain() -> None:
    """Raise ToolchainError naming the first missing piece: the iac extra, then Node.js."""
    missing = missing_modules()
    if missing:
        which = "are not installed" if len(missing) == len(IAC_MODULES) else f"lack {', '.join(missing)}"
        raise ToolchainError(
            f"meridian iac needs the cdktf packages of the `iac` extra, which this venv {which}: "
            "run `pip install -e '.[iac]'` (or `make install`)"
        )
    node = shutil.which("node")
    if node is None:
        raise ToolchainError(f"meridian iac needs Node.js {MIN_NODE_MAJOR} or newer (cdktf runs on it): {NODE_INSTALL_HINT}")
    major = node_major(node)
    if major is None:
        raise ToolchainError(f"{node} --version did not answer with a version: {NODE_INSTALL_HINT}")
    if major < MIN_NODE_MAJOR:
        raise ToolchainError(
            f"meridian iac needs Node.js {MIN_NODE_MAJOR} or newer, {node} is version {major}: {NODE_INSTALL_HINT}"
        )
