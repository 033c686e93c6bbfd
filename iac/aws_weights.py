"""An AWS region's weights bucket and the node role that reads it.

The bucket is private, versioned, encrypted and reachable over TLS only, and copies each
replicated model's prefix to the other buckets of its residency cluster; the nodes' role may
read the prefixes of the models placed in the region and the cluster token, nothing else.
IAM documents are written with sorted keys so that the same plan gives the same bytes.
"""

from __future__ import annotations

import json
from typing import Any

from cdktf_cdktf_provider_aws.data_aws_caller_identity import DataAwsCallerIdentity
from cdktf_cdktf_provider_aws.iam_instance_profile import IamInstanceProfile
from cdktf_cdktf_provider_aws.iam_role import IamRole
from cdktf_cdktf_provider_aws.iam_role_policy import IamRolePolicy
from cdktf_cdktf_provider_aws.s3_bucket import S3Bucket
from cdktf_cdktf_provider_aws.s3_bucket_ownership_controls import (
    S3BucketOwnershipControls,
    S3BucketOwnershipControlsRule,
)
from cdktf_cdktf_provider_aws.s3_bucket_policy import S3BucketPolicy
from cdktf_cdktf_provider_aws.s3_bucket_public_access_block import S3BucketPublicAccessBlock
from cdktf_cdktf_provider_aws.s3_bucket_replication_configuration import (
    S3BucketReplicationConfigurationA,
    S3BucketReplicationConfigurationRule,
    S3BucketReplicationConfigurationRuleDeleteMarkerReplication,
    S3BucketReplicationConfigurationRuleDestination,
    S3BucketReplicationConfigurationRuleFilter,
)
from cdktf_cdktf_provider_aws.s3_bucket_server_side_encryption_configuration import (
    S3BucketServerSideEncryptionConfigurationA,
    S3BucketServerSideEncryptionConfigurationRuleA,
    S3BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultA,
)
from cdktf_cdktf_provider_aws.s3_bucket_versioning import (
    S3BucketVersioningA,
    S3BucketVersioningVersioningConfiguration,
)
from constructs import Construct

from iac import layout
from iac.layout import RegionStack, Replication
from meridian.infra_plan import InfraPlan, InfraRegion

# Meridian's AWS regions are all in the commercial partition (providers.aws.regions).
ARN = "arn:aws"


def policy_json(statements: list[dict[str, Any]]) -> str:
    """An IAM policy document (sorted keys, so the same statements always give the same bytes)."""
    return json.dumps({"Version": "2012-10-17", "Statement": statements}, sort_keys=True)


def assume_role_policy(service: str) -> str:
    return policy_json([{"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}])


def bucket_arn(bucket: str) -> str:
    return f"{ARN}:s3:::{bucket}"


def weights_bucket(stack: Construct, plan: InfraPlan, region: InfraRegion) -> str:
    """The region's weights bucket: private, versioned (replication needs it), encrypted, TLS only;
    its name."""
    r, name = region.location, layout.bucket_name(plan, region)
    b = S3Bucket(stack, "weights", bucket=name, region=r, force_destroy=False)
    S3BucketPublicAccessBlock(
        stack,
        "weights_public_access",
        bucket=b.id,
        region=r,
        block_public_acls=True,
        block_public_policy=True,
        ignore_public_acls=True,
        restrict_public_buckets=True,
    )
    S3BucketOwnershipControls(
        stack,
        "weights_ownership",
        bucket=b.id,
        region=r,
        rule=S3BucketOwnershipControlsRule(object_ownership="BucketOwnerEnforced"),
    )
    versioning = S3BucketVersioningA(
        stack,
        "weights_versioning",
        bucket=b.id,
        region=r,
        versioning_configuration=S3BucketVersioningVersioningConfiguration(status="Enabled"),
    )
    S3BucketServerSideEncryptionConfigurationA(
        stack,
        "weights_sse",
        bucket=b.id,
        region=r,
        rule=[
            S3BucketServerSideEncryptionConfigurationRuleA(
                apply_server_side_encryption_by_default=(
                    S3BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultA(
                        sse_algorithm="AES256"
                    )
                )
            )
        ],
    )
    S3BucketPolicy(
        stack,
        "weights_tls_only",
        bucket=b.id,
        region=r,
        policy=policy_json(
            [
                {
                    "Sid": "DenyInsecureTransport",
                    "Effect": "Deny",
                    "Principal": "*",
                    "Action": "s3:*",
                    "Resource": [bucket_arn(name), f"{bucket_arn(name)}/*"],
                    "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                }
            ]
        ),
    )
    rules = [rep for rep in layout.replications(plan) if rep.source.name == region.name]
    if rules:
        _replication(stack, plan, region, b, versioning, rules)
    return name


def _replication(
    stack: Construct,
    plan: InfraPlan,
    region: InfraRegion,
    bucket: S3Bucket,
    versioning: S3BucketVersioningA,
    rules: list[Replication],
) -> None:
    """Copy each replicated model's prefix to the other buckets of its residency cluster."""
    r, source = region.location, layout.bucket_name(plan, region)
    keys = sorted({rep.key for rep in rules})
    role = IamRole(
        stack,
        "replication_role",
        name=layout.resource_name(plan, "replication", r),
        assume_role_policy=assume_role_policy("s3.amazonaws.com"),
    )
    destinations = sorted({(rep.key, layout.bucket_name(plan, rep.destination)) for rep in rules})
    IamRolePolicy(
        stack,
        "replication_policy",
        role=role.id,
        name="replicate-weights",
        policy=policy_json(
            [
                {
                    "Effect": "Allow",
                    "Action": ["s3:GetReplicationConfiguration", "s3:ListBucket"],
                    "Resource": [bucket_arn(source)],
                },
                {
                    "Effect": "Allow",
                    "Action": [
                        "s3:GetObjectVersionAcl",
                        "s3:GetObjectVersionForReplication",
                        "s3:GetObjectVersionTagging",
                    ],
                    "Resource": [f"{bucket_arn(source)}/{k}/*" for k in keys],
                },
                {
                    "Effect": "Allow",
                    "Action": ["s3:ReplicateDelete", "s3:ReplicateObject", "s3:ReplicateTags"],
                    "Resource": [f"{bucket_arn(dest)}/{k}/*" for k, dest in destinations],
                },
            ]
        ),
    )
    S3BucketReplicationConfigurationA(
        stack,
        "weights_replication",
        bucket=bucket.id,
        role=role.arn,
        region=r,
        depends_on=[versioning],
        rule=[
            S3BucketReplicationConfigurationRule(
                id=layout.fit(f"{layout.slug(rep.model)}-to-{rep.destination.location}", 255),
                priority=i,
                status="Enabled",
                filter=S3BucketReplicationConfigurationRuleFilter(prefix=f"{rep.key}/"),
                delete_marker_replication=S3BucketReplicationConfigurationRuleDeleteMarkerReplication(
                    status="Enabled"
                ),
                destination=S3BucketReplicationConfigurationRuleDestination(
                    bucket=bucket_arn(layout.bucket_name(plan, rep.destination)),
                    storage_class="STANDARD",
                ),
            )
            for i, rep in enumerate(rules)
        ],
    )


def node_profile(stack: Construct, plan: InfraPlan, rs: RegionStack, bucket: str) -> IamInstanceProfile:
    """The nodes' role: read this region's bucket (the prefixes of the models placed here) and the
    cluster token; nothing else, and no resource wildcards."""
    r = rs.region.location
    keys = sorted({layout.weights_key(plan.deployment(g.model)) for g in rs.groups})
    account = DataAwsCallerIdentity(stack, "current").account_id
    parameter = layout.cluster_token_name(plan, "aws").lstrip("/")
    role = IamRole(
        stack,
        "node_role",
        name=layout.resource_name(plan, "node", r),
        assume_role_policy=assume_role_policy("ec2.amazonaws.com"),
    )
    IamRolePolicy(
        stack,
        "node_policy",
        role=role.id,
        name="meridian-node",
        policy=policy_json(
            [
                {
                    "Sid": "ListModelPrefixes",
                    "Effect": "Allow",
                    "Action": ["s3:ListBucket"],
                    "Resource": [bucket_arn(bucket)],
                    "Condition": {"StringLike": {"s3:prefix": [p for k in keys for p in (k, f"{k}/*")]}},
                },
                {
                    "Sid": "ReadModelWeights",
                    "Effect": "Allow",
                    "Action": ["s3:GetObject"],
                    "Resource": [f"{bucket_arn(bucket)}/{k}/*" for k in keys],
                },
                {
                    "Sid": "ReadClusterToken",
                    "Effect": "Allow",
                    "Action": ["ssm:GetParameter"],
                    "Resource": [f"{ARN}:ssm:{r}:{account}:parameter/{parameter}"],
                },
            ]
        ),
    )
    return IamInstanceProfile(
        stack, "node_profile", name=layout.resource_name(plan, "node", r), role=role.name
    )
