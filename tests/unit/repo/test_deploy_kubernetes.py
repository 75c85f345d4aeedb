"""deploy/kubernetes: every object valid against the Kubernetes API's own schemas (kubernetes-validate,
strict: an unknown field is an error), and the manifests in agreement with the server they run."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml
from deploy_manifests import (
    DEPLOY, documents, drain_budget, empty_app, env_map, is_get_route, one, pre_stop_seconds, probe_budget,
    readiness_follows_the_drain, resolve, unread_names,
)

from lmi_serve.config import sources as config

K8S = DEPLOY / "kubernetes"
# The oldest Kubernetes these manifests claim (autoscaling/v2 HPA behavior, startup probes) and the newest
# kubernetes-validate knows.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
MANIFESTS = sorted(K8S.glob("*.yaml")) + [DEPLOY / "kserve" / "hpa.yaml"]


@pytest.fixture(scope="module")
def docs():
    return documents(K8S / "deployment.yaml") + documents(K8S / "hpa.yaml")


@pytest.fixture(scope="module")
def container(docs):
    (found,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return found


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_object_is_valid_kubernetes(path, version):
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_refuses_a_misspelt_field(docs):
    """The strict schemas are what catches a typo a cluster would silently drop."""
    deployment = yaml.safe_load(yaml.safe_dump(one(docs, "Deployment")))
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def test_probes_use_health_routes_the_server_serves_on_its_port(docs, container):
    app = empty_app()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.ServerConfig.model_fields["port"].default}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]["httpGet"]
        assert is_get_route(app, probe["path"]), f"{kind}: no GET route {probe['path']}"
        assert probe["port"] in ports
    service = one(docs, "Service")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    assert service["spec"]["selector"].items() <= one(docs, "Deployment")["spec"]["template"]["metadata"][
        "labels"].items()
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["http"]
    assert is_get_route(app, annotations["prometheus.io/path"])


def test_readiness_turns_unhealthy_when_the_drain_starts(container):
    """What the readiness probe reads: 200 when serving, 503 once SIGTERM came (drain.py sets `stopping`)."""
    assert readiness_follows_the_drain(container) == (200, 503)


def test_the_grace_period_outlasts_the_drain(docs, container, tmp_path):
    server = resolve(env_map(container), tmp_path)
    grace = one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain_budget(server.graceful_timeout, pre_stop_seconds(container))


def test_the_startup_probe_outlasts_the_model_load(container, tmp_path):
    (model,) = resolve(env_map(container), tmp_path).models
    assert probe_budget(container["startupProbe"]) > model.model_loading_timeout


def test_every_variable_is_one_lmi_serve_reads(container, tmp_path):
    env = env_map(container)
    assert unread_names(env, tmp_path) == []
    (model,) = resolve(env, tmp_path).models
    assert model.unknown_options == ()
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert model.tensor_parallel_degree == gpus  # one rank per GPU the pod gets


def test_the_hpa_scales_this_deployment_on_the_servers_queue_metric(docs):
    hpa, deployment = one(docs, "HorizontalPodAutoscaler"), one(docs, "Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    (metric,) = hpa["spec"]["metrics"]
    (rule,) = yaml.safe_load(one(documents(K8S / "prometheus-adapter.yaml"), "ConfigMap")["data"]["config.yaml"])[
        "rules"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    exported = rule["seriesQuery"].split("{")[0]
    body = empty_app().test_client().get("/metrics").get_data(as_text=True)
    assert f"# TYPE {exported} gauge" in body.splitlines()  # a gauge /metrics exports under that exact name
    assert "model_name" not in rule["metricsQuery"]  # summed over the pod's models, per pod


def test_the_kserve_hpa_targets_the_predictor_of_the_inference_service():
    (hpa,) = documents(DEPLOY / "kserve" / "hpa.yaml")
    isvc = one(documents(DEPLOY / "kserve" / "inferenceservice.yaml"), "InferenceService")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{isvc['metadata']['name']}-predictor"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "external"
    (ours,) = one(documents(K8S / "hpa.yaml"), "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert hpa["spec"]["metrics"] == [ours]
