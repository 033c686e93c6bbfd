"""Names of Meridian's GCP resources: the one place the driver and the Terraform stacks agree on them.

iac/ creates a regional instance template per machine type (and Spot or not) in each region, and
a regional managed instance group (MIG) per (model, region, machine type, Spot) at its first size;
the driver (providers.gcp.driver) adopts that MIG, or creates it from the template when iac has
not. Both sides spell every name with these functions, which take only what both know: never
the control plane's group id, which iac does not see. The region is implicit: templates and MIGs
are regional resources, named within their region. Pure functions of their arguments, no SDK
import.

Compute Engine names follow RFC 1035: a lowercase letter, then up to 62 lowercase letters,
digits or hyphens, not ending in a hyphen. A MIG appends "-" and four characters to its base
instance name, so that name is at most 58 characters (and the instance names, which are
Meridian's node ids, at most 63). Label values may hold lowercase letters, digits, "-" and "_",
up to 63 characters. A model slug cut to fit ends in a hash of the full model name, so two
models sharing a long prefix keep distinct names.

    instance_template_name("meridian", "a3-highgpu-8g", spot=True)  -> "meridian-a3-highgpu-8g-spot"
    mig_name("meridian", "meta-llama/Llama-3.1-8B", "g2-standard-8", spot=False)
        -> "meridian-meta-llama-llama-3-1-8b-g2-standard-8"
    base_instance_name("meridian", "meta-llama/Llama-3.1-8B", "gcp:us-central1", "g2-standard-8", False)
        -> "meridian-meta-llama-llama-3-1-8b-<8 hex of the region, machine type and Spot>"

A disaggregated deployment's prefill and decode VMs of one machine type are two MIGs: their
names end in "-prefill" / "-decode", their instance names hash the role too, and their VMs
carry the role as a label and as metadata (METADATA_PD_ROLE, which the node's boot reads into
MERIDIAN_NODE_ROLE, see iac.node_boot). A co-located MIG's names, labels and metadata are what
they were before prefill/decode roles existed.
"""

from __future__ import annotations

import hashlib
import re

NAME_MAX = 63
# The MIG adds "-xxxx" to the base instance name (InstanceGroupManager.baseInstanceName: 1-58 chars).
BASE_INSTANCE_NAME_MAX = 58
PREFIX_MAX = 20
# Hex digits of the model's hash that end a cut model slug (32 bits).
MODEL_HASH_LEN = 8

LABEL_GROUP_ID = "meridian-group-id"
LABEL_MODEL = "meridian-model"
LABEL_ROLE = "meridian-role"
ROLE_NODE = "gpu-node"
# Instance metadata keys the MIG sets on every VM (the node agent may read them from the metadata server).
METADATA_GROUP_ID = "meridian-group-id"
METADATA_MODEL = "meridian-model"
# A prefill or decode MIG's prefill/decode role (a meridian.contracts.NodeRole value), as a
# label and as metadata; absent: co-located.
LABEL_PD_ROLE = "meridian-pd-role"
METADATA_PD_ROLE = "meridian-pd-role"
CO_LOCATED = "both"

RFC1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_NOT_NAME = re.compile(r"[^a-z0-9]+")
_NOT_LABEL = re.compile(r"[^a-z0-9_-]+")


def slug(text: str) -> str:
    """`text` lowercased, each run of other characters made one hyphen ("Llama-3.1-8B" → "llama-3-1-8b")."""
    return _NOT_NAME.sub("-", text.lower()).strip("-")


def model_hash(model: str) -> str:
    """A short stable hash of a model's full name (not of its slug), for names that cut it."""
    return hashlib.sha256(model.encode()).hexdigest()[:MODEL_HASH_LEN]


def check_prefix(prefix: str) -> str:
    """The prefix as names use it: a slug of at most 20 characters starting with a letter."""
    p = slug(prefix)
    if not p or not p[0].isalpha() or len(p) > PREFIX_MAX:
        raise ValueError(
            f"GCP name prefix {prefix!r} must slug to 1-{PREFIX_MAX} lowercase letters, digits or hyphens "
            "starting with a letter"
        )
    return p


def _with_model(before: list[str], model: str, after: list[str], limit: int) -> str:
    """`before`, the model's slug and `after` joined by hyphens in at most `limit` characters; a slug
    that does not fit (or is empty) becomes its first characters and "-<model_hash>"."""
    fixed = "-".join([*before, *after])
    room = limit - len(fixed) - 1
    cleaned = slug(model)
    if not cleaned or len(cleaned) > room:
        keep = room - MODEL_HASH_LEN - 1
        if keep < 1:
            raise ValueError(f"cannot fit model {model!r} with {fixed!r} into {limit} characters")
        cleaned = f"{(cleaned or 'model')[:keep].rstrip('-')}-{model_hash(model)}"
    return "-".join([*before, cleaned, *after])


def instance_template_name(prefix: str, machine_type: str, spot: bool) -> str:
    """The regional instance template iac creates for a machine type (on-demand or Spot VMs) in each
    region that uses it: a regional template carries its region's subnetwork, so the same name
    stands for one template per region (`projects/{p}/regions/{r}/instanceTemplates/{name}`).

    Long names (a prefix plus a long machine type) keep a 6-hex-digit hash of the full name so
    that two templates never share one.
    """
    name = "-".join([check_prefix(prefix), slug(machine_type), *(["spot"] if spot else [])])
    if len(name) > NAME_MAX:
        digest = hashlib.sha256(name.encode()).hexdigest()[:6]
        name = f"{name[: NAME_MAX - 7].rstrip('-')}-{digest}"
    return name


def mig_name(prefix: str, model: str, machine_type: str, spot: bool, role: str = CO_LOCATED) -> str:
    """The regional MIG of a model's VMs of one machine type (Spot or not) in a region:
    "<prefix>-<model slug>-<machine type>[-spot]", then "-<role>" for a prefill or decode MIG,
    the model slug cut (and hashed) to fit."""
    after = [slug(machine_type), *(["spot"] if spot else []), *([slug(role)] if role != CO_LOCATED else [])]
    return _with_model([check_prefix(prefix)], model, after, NAME_MAX)


def base_instance_name(
    prefix: str, model: str, region: str, machine_type: str, spot: bool, role: str = CO_LOCATED
) -> str:
    """The MIG's base instance name "<prefix>-<model slug>-<8 hex>"; its VMs are named
    "<base>-<4 characters>" and those names are Meridian node ids, unique across the fleet. The
    hex digits hash the group's region, machine type, Spot-ness and (for a prefill or decode
    MIG) role, so two MIGs of one model never draw names from the same space."""
    key = f"{region}|{machine_type}|{'spot' if spot else 'standard'}" + (f"|{role}" if role != CO_LOCATED else "")
    group = hashlib.sha256(key.encode()).hexdigest()[:8]
    return _with_model([check_prefix(prefix)], model, [group], BASE_INSTANCE_NAME_MAX)


def label_value(text: str) -> str:
    """`text` as a GCP label value: lowercase letters, digits, "-" and "_", at most 63 characters."""
    return _NOT_LABEL.sub("-", text.lower()).strip("-")[:NAME_MAX]


def group_labels(model: str, group_id: str, role: str = ROLE_NODE, pd_role: str = CO_LOCATED) -> dict[str, str]:
    """Labels every VM of a MIG the driver creates carries (set through its all-instances config); iac's
    MIGs carry LABEL_MODEL and LABEL_ROLE, and the driver checks LABEL_MODEL before adopting one.
    A prefill or decode MIG's VMs also carry LABEL_PD_ROLE."""
    labels = {
        LABEL_GROUP_ID: label_value(group_id),
        LABEL_MODEL: label_value(model),
        LABEL_ROLE: label_value(role),
    }
    if pd_role != CO_LOCATED:
        labels[LABEL_PD_ROLE] = label_value(pd_role)
    return labels


def group_metadata(model: str, group_id: str, pd_role: str = CO_LOCATED) -> dict[str, str]:
    """Metadata every VM of a MIG the driver creates carries: its group and model, and a prefill or
    decode MIG's role (what the node's boot reads into MERIDIAN_NODE_MODEL_NAME / MERIDIAN_NODE_ROLE)."""
    metadata = {METADATA_GROUP_ID: group_id, METADATA_MODEL: model}
    if pd_role != CO_LOCATED:
        metadata[METADATA_PD_ROLE] = pd_role
    return metadata
