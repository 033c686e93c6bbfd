"""The global stack: the control plane's Postgres, the routers' Redis and the endpoint's DNS name.

They live in the global region (`plan.global`), inside the network of that region's stack, which
they find by name and tags at apply time (so the global stack depends on that stack, not on its
state). Neither database has a public address; both encrypt at rest and in transit.
"""

from __future__ import annotations

from cdktf import Fn, TerraformOutput, TerraformStack, TerraformVariable, Token
from cdktf_cdktf_provider_aws.data_aws_route53_zone import DataAwsRoute53Zone
from cdktf_cdktf_provider_aws.data_aws_subnets import DataAwsSubnets, DataAwsSubnetsFilter
from cdktf_cdktf_provider_aws.data_aws_vpc import DataAwsVpc, DataAwsVpcFilter
from cdktf_cdktf_provider_aws.db_instance import DbInstance
from cdktf_cdktf_provider_aws.db_subnet_group import DbSubnetGroup
from cdktf_cdktf_provider_aws.elasticache_replication_group import ElasticacheReplicationGroup
from cdktf_cdktf_provider_aws.elasticache_subnet_group import ElasticacheSubnetGroup
from cdktf_cdktf_provider_aws.route53_record import Route53Record
from cdktf_cdktf_provider_aws.security_group import SecurityGroup, SecurityGroupIngress
from cdktf_cdktf_provider_google.compute_global_address import ComputeGlobalAddress
from cdktf_cdktf_provider_google.data_google_compute_network import DataGoogleComputeNetwork
from cdktf_cdktf_provider_google.data_google_dns_managed_zone import DataGoogleDnsManagedZone
from cdktf_cdktf_provider_google.dns_record_set import DnsRecordSet
from cdktf_cdktf_provider_google.redis_instance import RedisInstance
from cdktf_cdktf_provider_google.service_networking_connection import ServiceNetworkingConnection
from cdktf_cdktf_provider_google.sql_database import SqlDatabase
from cdktf_cdktf_provider_google.sql_database_instance import (
    SqlDatabaseInstance,
    SqlDatabaseInstanceSettings,
    SqlDatabaseInstanceSettingsBackupConfiguration,
    SqlDatabaseInstanceSettingsIpConfiguration,
)
from constructs import Construct

from iac import layout
from iac.aws import INSTALLATION_TAG, TIER_TAG, aws_provider
from iac.gcp import google_provider
from meridian.infra_plan import InfraPlan
from providers.gcp import naming as gcp_naming

POSTGRES_PORT = 5432
REDIS_PORT = 6379
DNS_TTL_S = 60
DATABASE = "meridian"
# ElastiCache replication group ids: at most 40 characters.
REDIS_ID_MAX = 40


class GlobalStack(TerraformStack):
    """Postgres, Redis and DNS for the whole installation, on AWS or GCP (`plan.global.provider`)."""

    def __init__(self, scope: Construct, plan: InfraPlan) -> None:
        super().__init__(scope, layout.GLOBAL_STACK)
        self.plan = plan
        self.region = plan.region(plan.global_.region)
        self.prefix = layout.prefix(plan)
        self.records = layout.dns_records(plan.global_.router_addresses)
        if plan.global_.provider == "aws":
            self._aws()
        else:
            self._gcp()

    # --- AWS: RDS for PostgreSQL, ElastiCache for Redis, Route 53 ---------------------------

    def _aws(self) -> None:
        plan = self.plan
        aws_provider(self, self.region.location, self.prefix, self.region.name)
        db_class = TerraformVariable(
            self,
            "db_instance_class",
            type="string",
            default="db.m6g.large",
            description="RDS instance class of the control plane's Postgres.",
        )
        redis_type = TerraformVariable(
            self,
            "redis_node_type",
            type="string",
            default="cache.m6g.large",
            description="ElastiCache node type of the routers' Redis.",
        )
        clients = TerraformVariable(
            self,
            "control_plane_cidrs",
            type="list(string)",
            default=[],
            description="Addresses outside the VPC (control planes, routers) that may reach Postgres "
            "and Redis.",
        )
        vpc, subnets = self._aws_network()
        sources = Token.as_list(Fn.concat([[vpc.cidr_block], clients.list_value]))
        db = self._aws_postgres(db_class, vpc, subnets, sources)
        redis = self._aws_redis(redis_type, vpc, subnets, sources)
        if self.records:
            zone = DataAwsRoute53Zone(self, "zone", name=plan.global_.dns_zone, private_zone=False)
            for kind, values in self.records:
                Route53Record(
                    self,
                    f"endpoint_{kind.lower()}",
                    zone_id=zone.zone_id,
                    name=plan.global_.endpoint_domain,
                    type=kind,
                    ttl=DNS_TTL_S,
                    records=values,
                )
        TerraformOutput(self, "postgres_endpoint", value=db.endpoint)
        TerraformOutput(self, "postgres_password_secret", value=db.master_user_secret.get(0).secret_arn)
        TerraformOutput(self, "redis_endpoint", value=redis.primary_endpoint_address)
        TerraformOutput(self, "endpoint", value=plan.global_.endpoint_domain)

    def _aws_network(self) -> tuple[DataAwsVpc, DataAwsSubnets]:
        """The global region's VPC and its private subnets, found by the region stack's name and tags."""
        r, plan = self.region.location, self.plan
        vpc = DataAwsVpc(
            self,
            "vpc",
            region=r,
            filter=[
                DataAwsVpcFilter(name="tag:Name", values=[layout.resource_name(plan, "nodes", r)]),
                DataAwsVpcFilter(name=f"tag:{INSTALLATION_TAG}", values=[self.prefix]),
            ],
        )
        subnets = DataAwsSubnets(
            self,
            "private_subnets",
            region=r,
            filter=[
                DataAwsSubnetsFilter(name="vpc-id", values=[vpc.id]),
                DataAwsSubnetsFilter(name=f"tag:{TIER_TAG}", values=["private"]),
            ],
        )
        return vpc, subnets

    def _aws_firewall(self, tf_id: str, what: str, port: int, vpc: DataAwsVpc, sources: list[str]) -> SecurityGroup:
        return SecurityGroup(
            self,
            tf_id,
            name=layout.resource_name(self.plan, what),
            vpc_id=vpc.id,
            region=self.region.location,
            description=f"Meridian {what}: port {port} from the VPC and control planes only",
            ingress=[SecurityGroupIngress(from_port=port, to_port=port, protocol="tcp", cidr_blocks=sources)],
        )

    def _aws_postgres(
        self, db_class: TerraformVariable, vpc: DataAwsVpc, subnets: DataAwsSubnets, sources: list[str]
    ) -> DbInstance:
        """RDS for PostgreSQL: multi-AZ, encrypted, private, its password kept by RDS."""
        r, plan = self.region.location, self.plan
        db_sg = self._aws_firewall("postgres_sg", "postgres", POSTGRES_PORT, vpc, sources)
        db_subnets = DbSubnetGroup(
            self,
            "postgres_subnets",
            name=layout.resource_name(plan, "postgres"),
            subnet_ids=subnets.ids,
            region=r,
        )
        return DbInstance(
            self,
            "postgres",
            identifier=layout.resource_name(plan, "control-plane", limit=63),
            region=r,
            engine="postgres",
            engine_version="16",
            instance_class=db_class.string_value,
            allocated_storage=100,
            max_allocated_storage=1000,
            storage_type="gp3",
            storage_encrypted=True,
            publicly_accessible=False,
            multi_az=True,
            db_subnet_group_name=db_subnets.name,
            vpc_security_group_ids=[db_sg.id],
            db_name=DATABASE,
            username=DATABASE,
            # RDS keeps the password in Secrets Manager: it never enters Terraform's state.
            manage_master_user_password=True,
            backup_retention_period=14,
            deletion_protection=True,
            copy_tags_to_snapshot=True,
            skip_final_snapshot=False,
            final_snapshot_identifier=layout.resource_name(plan, "control-plane-final"),
            auto_minor_version_upgrade=True,
        )

    def _aws_redis(
        self, redis_type: TerraformVariable, vpc: DataAwsVpc, subnets: DataAwsSubnets, sources: list[str]
    ) -> ElasticacheReplicationGroup:
        """ElastiCache for Redis: a primary and a replica in two zones, encrypted at rest and in transit."""
        r, plan = self.region.location, self.plan
        redis_sg = self._aws_firewall("redis_sg", "redis", REDIS_PORT, vpc, sources)
        redis_subnets = ElasticacheSubnetGroup(
            self, "redis_subnets", name=layout.resource_name(plan, "redis"), subnet_ids=subnets.ids, region=r
        )
        return ElasticacheReplicationGroup(
            self,
            "redis",
            replication_group_id=layout.resource_name(plan, "router", limit=REDIS_ID_MAX),
            region=r,
            description="Meridian routers' shared fleet state",
            engine="redis",
            engine_version="7.1",
            node_type=redis_type.string_value,
            num_cache_clusters=2,
            automatic_failover_enabled=True,
            multi_az_enabled=True,
            port=REDIS_PORT,
            subnet_group_name=redis_subnets.name,
            security_group_ids=[redis_sg.id],
            at_rest_encryption_enabled="true",
            transit_encryption_enabled=True,
            transit_encryption_mode="required",
            snapshot_retention_limit=1,
        )

    # --- GCP: Cloud SQL for PostgreSQL, Memorystore for Redis, Cloud DNS -------------------

    def _gcp(self) -> None:
        r, plan = self.region.location, self.plan
        project = TerraformVariable(
            self,
            "project",
            type="string",
            description="GCP project of the control plane's state (the global region's).",
        )
        google_provider(self, project, r, self.prefix, self.region.name)
        tier = TerraformVariable(
            self,
            "db_tier",
            type="string",
            default="db-custom-2-7680",
            description="Cloud SQL machine tier of the control plane's Postgres.",
        )
        redis_gb = TerraformVariable(
            self,
            "redis_memory_gb",
            type="number",
            default=5,
            description="Memorystore capacity of the routers' Redis.",
        )
        dns_zone = TerraformVariable(
            self,
            "dns_managed_zone",
            type="string",
            default=layout.slug(plan.global_.dns_zone),
            description=f"Cloud DNS managed zone (resource name) of {plan.global_.dns_zone}.",
        )
        network = DataGoogleComputeNetwork(
            self, "network", name=layout.resource_name(plan, "nodes", r, limit=gcp_naming.NAME_MAX)
        )
        connection = self._gcp_private_services(network)
        db = self._gcp_postgres(tier, network, connection)
        SqlDatabase(self, "database", name=DATABASE, instance=db.name)
        redis = RedisInstance(
            self,
            "redis",
            name=layout.resource_name(plan, "router", limit=40),
            region=r,
            tier="STANDARD_HA",
            memory_size_gb=redis_gb.number_value,
            redis_version="REDIS_7_2",
            authorized_network=network.id,
            connect_mode="PRIVATE_SERVICE_ACCESS",
            transit_encryption_mode="SERVER_AUTHENTICATION",
            auth_enabled=True,
            depends_on=[connection],
        )
        if self.records:
            zone = DataGoogleDnsManagedZone(self, "zone", name=dns_zone.string_value)
            for kind, values in self.records:
                DnsRecordSet(
                    self,
                    f"endpoint_{kind.lower()}",
                    managed_zone=zone.name,
                    name=f"{plan.global_.endpoint_domain}.",
                    type=kind,
                    ttl=DNS_TTL_S,
                    rrdatas=[f"{v}." if kind == "CNAME" else v for v in values],
                )
        TerraformOutput(self, "postgres_connection_name", value=db.connection_name)
        TerraformOutput(self, "postgres_private_ip", value=db.private_ip_address)
        TerraformOutput(self, "redis_host", value=redis.host)
        TerraformOutput(self, "endpoint", value=plan.global_.endpoint_domain)

    def _gcp_private_services(self, network: DataGoogleComputeNetwork) -> ServiceNetworkingConnection:
        """Private services access: Cloud SQL and Memorystore get addresses inside the network, none public."""
        peering = ComputeGlobalAddress(
            self,
            "private_services_range",
            name=layout.resource_name(self.plan, "private-services", limit=gcp_naming.NAME_MAX),
            purpose="VPC_PEERING",
            address_type="INTERNAL",
            prefix_length=16,
            network=network.id,
        )
        return ServiceNetworkingConnection(
            self,
            "private_services",
            network=network.id,
            service="servicenetworking.googleapis.com",
            reserved_peering_ranges=[peering.name],
        )

    def _gcp_postgres(
        self, tier: TerraformVariable, network: DataGoogleComputeNetwork, connection: ServiceNetworkingConnection
    ) -> SqlDatabaseInstance:
        """Cloud SQL for PostgreSQL: regional, private address only, TLS only, point-in-time recovery."""
        return SqlDatabaseInstance(
            self,
            "postgres",
            name=layout.resource_name(self.plan, "control-plane", limit=gcp_naming.NAME_MAX),
            region=self.region.location,
            database_version="POSTGRES_16",
            deletion_protection=True,
            depends_on=[connection],
            # Cloud SQL always encrypts storage (Google-managed keys unless encryption_key_name is set).
            settings=SqlDatabaseInstanceSettings(
                tier=tier.string_value,
                availability_type="REGIONAL",
                disk_type="PD_SSD",
                disk_autoresize=True,
                deletion_protection_enabled=True,
                ip_configuration=SqlDatabaseInstanceSettingsIpConfiguration(
                    ipv4_enabled=False, private_network=network.id, ssl_mode="ENCRYPTED_ONLY"
                ),
                backup_configuration=SqlDatabaseInstanceSettingsBackupConfiguration(
                    enabled=True, point_in_time_recovery_enabled=True
                ),
            ),
        )
