"""cdktf app that turns an infrastructure plan (meridian.infra_plan) into Terraform JSON stacks.

cdktf and the provider bindings are imported only by the stack modules (aws, gcp, onprem,
global_stack, app); `layout`, `node_boot`, `diff` and `cli` stay importable without them, so
`meridian --help` does not pay jsii's start-up (about a minute per cloud's bindings).
"""

import os

# jsii prints a full-screen banner on Node versions it no longer supports; the synthesised JSON
# does not depend on the Node version, so the banner is noise. Set before any cdktf import.
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "18,20")
