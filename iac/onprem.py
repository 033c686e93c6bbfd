"""One on-prem Kubernetes site's stack: a namespace and a node-agent DaemonSet per node group.

A DaemonSet cannot count, so each group's DaemonSet runs on the GPU hosts (gpu_node_label=true)
that also carry the group's label, `meridian.io/node-group=<name>`; labelling `instances` hosts
is the operator's (or the reconciler's) step, and the stack's `node_group_labels` output lists
the labels to set. A host without one runs nothing, so no two models share its GPUs by accident.
Nodes use the host's network: routers outside the cluster reach them at the host's address.
"""

from __future__ import annotations

import shlex

from cdktf import TerraformOutput, TerraformStack, TerraformVariable
from cdktf_cdktf_provider_kubernetes.daemon_set_v1 import (
    DaemonSetV1,
    DaemonSetV1Metadata,
    DaemonSetV1Spec,
    DaemonSetV1SpecSelector,
    DaemonSetV1SpecStrategy,
    DaemonSetV1SpecStrategyRollingUpdate,
    DaemonSetV1SpecTemplate,
    DaemonSetV1SpecTemplateMetadata,
    DaemonSetV1SpecTemplateSpec,
    DaemonSetV1SpecTemplateSpecContainer,
    DaemonSetV1SpecTemplateSpecContainerEnv,
    DaemonSetV1SpecTemplateSpecContainerEnvValueFrom,
    DaemonSetV1SpecTemplateSpecContainerEnvValueFromFieldRef,
    DaemonSetV1SpecTemplateSpecContainerEnvValueFromSecretKeyRef,
    DaemonSetV1SpecTemplateSpecContainerPort,
    DaemonSetV1SpecTemplateSpecContainerReadinessProbe,
    DaemonSetV1SpecTemplateSpecContainerReadinessProbeHttpGet,
    DaemonSetV1SpecTemplateSpecContainerResources,
    DaemonSetV1SpecTemplateSpecContainerVolumeMount,
    DaemonSetV1SpecTemplateSpecToleration,
    DaemonSetV1SpecTemplateSpecVolume,
    DaemonSetV1SpecTemplateSpecVolumeHostPath,
)
from cdktf_cdktf_provider_kubernetes.namespace_v1 import NamespaceV1, NamespaceV1Metadata
from cdktf_cdktf_provider_kubernetes.provider import KubernetesProvider
from constructs import Construct

from iac import layout
from iac.layout import KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT, NODE_GROUP_LABEL, NODE_PORT, RegionStack
from iac.node_boot import node_env
from meridian.infra_plan import InfraGroup, InfraPlan

APP_LABEL = "app.kubernetes.io/name"
APP = "meridian-node"
REGION_LABEL = "meridian.io/region"
GPU_RESOURCE = "nvidia.com/gpu"
# A checkpoint staged on the host, for a deployment whose weights were never pushed anywhere.
HOST_MODELS_DIR = "/var/lib/meridian/models"
DEFAULT_IMAGE = "vllm/vllm-openai:v0.10.0"
# Drain (NodeSettings.drain_timeout_s, 30 s) plus vLLM's stop grace before Kubernetes kills the pod.
TERMINATION_GRACE_S = 90


def _env(name: str, value: str) -> DaemonSetV1SpecTemplateSpecContainerEnv:
    return DaemonSetV1SpecTemplateSpecContainerEnv(name=name, value=layout.tf_literal(value))


def _field(name: str, path: str) -> DaemonSetV1SpecTemplateSpecContainerEnv:
    return DaemonSetV1SpecTemplateSpecContainerEnv(
        name=name,
        value_from=DaemonSetV1SpecTemplateSpecContainerEnvValueFrom(
            field_ref=DaemonSetV1SpecTemplateSpecContainerEnvValueFromFieldRef(field_path=path)
        ),
    )


def group_label(group: InfraGroup) -> str:
    """The value of NODE_GROUP_LABEL that the hosts of a group carry."""
    return layout.dns_label(group.model, group.instance_type)


class OnPremStack(TerraformStack):
    """The node agent on an on-prem site's Kubernetes GPU hosts."""

    def __init__(self, scope: Construct, plan: InfraPlan, rs: RegionStack) -> None:
        super().__init__(scope, rs.name)
        if rs.site is None or rs.site.kubernetes is None:
            raise layout.PlanError(f"{rs.region.name}: an on-prem stack needs a Kubernetes site")
        self.plan, self.rs, self.k8s = plan, rs, rs.site.kubernetes
        kubeconfig = TerraformVariable(
            self,
            "kubeconfig_path",
            type="string",
            default="~/.kube/config",
            description="kubeconfig holding the site's context.",
        )
        self.image = TerraformVariable(
            self,
            "node_image",
            type="string",
            default=DEFAULT_IMAGE,
            description="Container image with CUDA and Python; the agent package is installed into it "
            "at start.",
        )
        KubernetesProvider(
            self, "kubernetes", config_path=kubeconfig.string_value, config_context=self.k8s.config_context
        )
        self.namespace = NamespaceV1(
            self,
            "namespace",
            metadata=NamespaceV1Metadata(
                name=self.k8s.namespace, labels={"app.kubernetes.io/part-of": "meridian"}
            ),
        )
        for group in rs.groups:
            self._daemon_set(group)
        TerraformOutput(
            self,
            "node_group_labels",
            value={
                layout.dns_label(g.model, g.instance_type): f"{NODE_GROUP_LABEL}={group_label(g)}"
                for g in rs.groups
            },
        )

    def _model_env(self, group: InfraGroup) -> list[DaemonSetV1SpecTemplateSpecContainerEnv]:
        uri = self.plan.deployment(group.model).weights_uri
        if uri:
            return [_env("MERIDIAN_NODE_MODEL_URI", uri)]
        return [_env("MERIDIAN_NODE_MODEL_DIR", f"{HOST_MODELS_DIR}/{layout.slug(group.model)}")]

    def _container_env(self, group: InfraGroup) -> list[DaemonSetV1SpecTemplateSpecContainerEnv]:
        """The node's settings, its identity from the pod (host name and address), its cluster token."""
        return [
            *(
                _env(k, v)
                for k, v in sorted(node_env(self.rs.region.name, self.plan.control_plane_url).items())
            ),
            _env("MERIDIAN_NODE_MODEL_NAME", group.model),
            *self._model_env(group),
            _field("MERIDIAN_NODE_NODE_ID", "spec.nodeName"),
            _field("HOST_IP", "status.hostIP"),
            # Kubernetes expands $(HOST_IP) from the variable above.
            _env("MERIDIAN_NODE_ADVERTISE_URL", f"http://$(HOST_IP):{NODE_PORT}"),
            DaemonSetV1SpecTemplateSpecContainerEnv(
                name="MERIDIAN_CLUSTER_TOKEN",
                value_from=DaemonSetV1SpecTemplateSpecContainerEnvValueFrom(
                    secret_key_ref=DaemonSetV1SpecTemplateSpecContainerEnvValueFromSecretKeyRef(
                        name=layout.cluster_token_name(self.plan, "onprem"), key="token"
                    )
                ),
            ),
        ]

    def _container(self, group: InfraGroup) -> DaemonSetV1SpecTemplateSpecContainer:
        """The node agent, installed into the image at start, on the host's GPUs and ports."""
        package = shlex.quote(self.plan.agent_package)
        install = f"pip install --no-cache-dir --timeout 60 {package} && exec meridian node run"
        return DaemonSetV1SpecTemplateSpecContainer(
            name="node",
            image=self.image.string_value,
            command=["/bin/sh", "-c"],
            args=[layout.tf_literal(install)],
            env=self._container_env(group),
            port=[
                DaemonSetV1SpecTemplateSpecContainerPort(
                    name=n, container_port=p, host_port=p, protocol="TCP"
                )
                for n, p in (
                    ("http", NODE_PORT),
                    ("kv-events", KV_EVENTS_PORT),
                    ("kv-replay", KV_EVENTS_REPLAY_PORT),
                )
            ],
            resources=DaemonSetV1SpecTemplateSpecContainerResources(
                limits={GPU_RESOURCE: str(group.gpus_per_instance)}
            ),
            readiness_probe=DaemonSetV1SpecTemplateSpecContainerReadinessProbe(
                http_get=DaemonSetV1SpecTemplateSpecContainerReadinessProbeHttpGet(
                    path="/health", port=str(NODE_PORT)
                ),
                period_seconds=5,
                timeout_seconds=2,
            ),
            volume_mount=[
                DaemonSetV1SpecTemplateSpecContainerVolumeMount(
                    name="meridian", mount_path="/var/lib/meridian"
                )
            ],
        )

    def _daemon_set(self, group: InfraGroup) -> None:
        name = layout.dns_label(layout.prefix(self.plan), group.model, group.instance_type)
        labels = {
            APP_LABEL: APP,
            NODE_GROUP_LABEL: group_label(group),
            REGION_LABEL: layout.dns_label(self.rs.region.name),
        }
        selector = {APP_LABEL: APP, NODE_GROUP_LABEL: group_label(group)}
        DaemonSetV1(
            self,
            layout.tf_id("ds", name),
            metadata=DaemonSetV1Metadata(name=name, namespace=self.namespace.metadata.name, labels=labels),
            spec=DaemonSetV1Spec(
                selector=DaemonSetV1SpecSelector(match_labels=selector),
                strategy=DaemonSetV1SpecStrategy(
                    type="RollingUpdate",
                    rolling_update=DaemonSetV1SpecStrategyRollingUpdate(max_unavailable="1"),
                ),
                template=DaemonSetV1SpecTemplate(
                    metadata=DaemonSetV1SpecTemplateMetadata(labels=labels),
                    spec=DaemonSetV1SpecTemplateSpec(
                        node_selector={self.k8s.gpu_node_label: "true", NODE_GROUP_LABEL: group_label(group)},
                        toleration=[
                            DaemonSetV1SpecTemplateSpecToleration(
                                key=GPU_RESOURCE, operator="Exists", effect="NoSchedule"
                            )
                        ],
                        host_network=True,
                        dns_policy="ClusterFirstWithHostNet",
                        termination_grace_period_seconds=TERMINATION_GRACE_S,
                        container=[self._container(group)],
                        # Weight cache (and staged checkpoints) survive pod restarts on the host.
                        volume=[
                            DaemonSetV1SpecTemplateSpecVolume(
                                name="meridian",
                                host_path=(
                                    DaemonSetV1SpecTemplateSpecVolumeHostPath(
                                        path="/var/lib/meridian", type="DirectoryOrCreate"
                                    )
                                ),
                            )
                        ],
                    ),
                ),
            ),
            wait_for_rollout=False,
        )
