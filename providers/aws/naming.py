"""Names and tags of the AWS resources that the Terraform stacks (iac) and the driver share.

iac creates a launch template per instance type, tags the subnets GPU nodes may use, and creates
an Auto Scaling group per (model, region, instance type, spot) at its first size; the driver
finds all three by these names and tags at run time, adopting the group iac made (or creating
it when iac has not). A group's name is therefore computed from what both sides know (prefix,
model, instance type, spot), never from the control plane's group id, which iac never sees;
the region is implicit, Auto Scaling groups being regional. Both sides call these functions,
so a name is spelled in one place only. Pure functions: no SDK is imported here.

Names use lowercase letters, digits and `-` only, which every AWS name field accepts.

A disaggregated deployment's prefill and decode nodes of one instance type are two groups:
their names end in "-prefill" / "-decode" and they carry PD_ROLE_TAG (propagated to their
instances, whose boot reads it into MERIDIAN_NODE_ROLE, see iac.node_boot). A co-located
group's name and tags are what they were before prefill/decode roles existed.
"""

from __future__ import annotations

import hashlib
import re

# Tag keys. Subnets that GPU nodes may be launched in carry ROLE_TAG=SUBNET_ROLE; every node
# group's Auto Scaling group (and, propagated at launch, its instances) carries MODEL_TAG and
# ROLE_TAG=NODE_ROLE, and GROUP_ID_TAG once the driver has created or adopted it.
GROUP_ID_TAG = "meridian:group-id"
MODEL_TAG = "meridian:model"
ROLE_TAG = "meridian:role"
NODE_ROLE = "gpu-node"
SUBNET_ROLE = "gpu-subnet"
# A prefill or decode group's prefill/decode role (a meridian.contracts.NodeRole value); absent: co-located.
PD_ROLE_TAG = "meridian:pd-role"
CO_LOCATED = "both"

# AWS's limits: launch template names 3-128 characters, Auto Scaling group names 1-255.
LAUNCH_TEMPLATE_NAME_MAX = 128
AUTO_SCALING_GROUP_NAME_MAX = 255
# Room left for the model in a group name, so that names stay readable in the console.
MODEL_SLUG_MAX = 64
# Hex digits of the model's hash that end a cut model slug (32 bits).
MODEL_HASH_LEN = 8

_NOT_SLUG = re.compile(r"[^a-z0-9]+")


def slug(text: str) -> str:
    """`text` in lowercase letters, digits and single dashes: "Llama-3.1 8B" → "llama-3-1-8b"."""
    return _NOT_SLUG.sub("-", text.lower()).strip("-")


def _prefix(prefix: str) -> str:
    cleaned = slug(prefix)
    if not cleaned:
        raise ValueError(f"AWS name prefix {prefix!r} has no letter or digit")
    return cleaned


def _instance_slug(instance_type: str) -> str:
    cleaned = slug(instance_type)
    if not cleaned:
        raise ValueError(f"instance type {instance_type!r} has no letter or digit")
    return cleaned


def launch_template_name(prefix: str, instance_type: str, spot: bool = False) -> str:
    """The launch template iac creates for an instance type: "meridian-p5-48xlarge" (dots become
    dashes), "meridian-p5-48xlarge-spot" for spot groups.

    A spot template must not set InstanceMarketOptions: groups ask for spot capacity through
    their mixed instances policy, which AWS refuses to combine with a spot launch template.
    """
    name = f"{_prefix(prefix)}-{_instance_slug(instance_type)}" + ("-spot" if spot else "")
    if len(name) > LAUNCH_TEMPLATE_NAME_MAX:
        raise ValueError(f"launch template name {name!r} is longer than {LAUNCH_TEMPLATE_NAME_MAX} characters")
    return name


def model_hash(model: str) -> str:
    """A short stable hash of a model's full name (not of its slug), for names that cut it."""
    return hashlib.sha256(model.encode()).hexdigest()[:MODEL_HASH_LEN]


def model_part(model: str, room: int = MODEL_SLUG_MAX) -> str:
    """The model's slug when it fits in `room` characters; otherwise its first characters and
    "-<model_hash>", so that two models sharing a long prefix keep distinct names ("model-<hash>"
    stands for a model of symbols only)."""
    cleaned = slug(model)
    if cleaned and len(cleaned) <= room:
        return cleaned
    keep = room - MODEL_HASH_LEN - 1
    if keep < 1:
        raise ValueError(f"no room for model {model!r} in {room} characters")
    return f"{(cleaned or 'model')[:keep].rstrip('-')}-{model_hash(model)}"


def auto_scaling_group_name(prefix: str, model: str, instance_type: str, spot: bool, role: str = CO_LOCATED) -> str:
    """The Auto Scaling group of a model's nodes of one instance type (and market) in a region:
    "<prefix>-<model part>-<instance type slug>[-spot]", then "-<role>" for a prefill or decode group.

    The model part is its slug, cut to MODEL_SLUG_MAX characters with a hash of the full model
    name (`model_part`). The region is not part of the name because Auto Scaling groups are
    regional; the control plane's group id is not either, because iac, which may create the
    group first, does not know it.
    """
    parts = [_prefix(prefix), model_part(model), _instance_slug(instance_type)]
    if spot:
        parts.append("spot")
    if role != CO_LOCATED:
        parts.append(slug(role))
    name = "-".join(parts)
    if len(name) > AUTO_SCALING_GROUP_NAME_MAX:
        raise ValueError(f"Auto Scaling group name {name!r} is longer than {AUTO_SCALING_GROUP_NAME_MAX} characters")
    return name


def group_tags(group_id: str, model: str, role: str = CO_LOCATED) -> dict[str, str]:
    """Tags the driver puts on an Auto Scaling group it creates, propagated to its instances (iac's
    groups carry MODEL_TAG and ROLE_TAG; the driver adds GROUP_ID_TAG when it adopts one), and
    PD_ROLE_TAG on a prefill or decode group."""
    tags = {GROUP_ID_TAG: group_id, MODEL_TAG: model, ROLE_TAG: NODE_ROLE}
    if role != CO_LOCATED:
        tags[PD_ROLE_TAG] = role
    return tags


def subnet_tags() -> dict[str, str]:
    """Tags iac puts on the subnets that GPU nodes may be launched in."""
    return {ROLE_TAG: SUBNET_ROLE}
