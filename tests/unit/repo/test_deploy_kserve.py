"""deploy/kserve: the ServingRuntime and InferenceService against the schemas written down from KServe's
CRDs (deploy/kserve/schemas/), their core/v1 parts (containers, pod fields) against Kubernetes' own
(kubernetes-validate), and both in agreement with each other and with the server."""

from __future__ import annotations

import copy
import json

import jsonschema
import kubernetes_validate
import pytest
from deploy_manifests import (
    DEPLOY, documents, drain_budget, empty_app, env_map, is_get_route, one, pre_stop_seconds, probe_budget,
    readiness_follows_the_drain, resolve, unread_names,
)

from lmi_serve.__main__ import parse_args
from lmi_serve.config import sources as config

KSERVE = DEPLOY / "kserve"
K8S_VERSION = "1.30.0"
# ModelSpec / PredictorExtensionSpec fields beside the core/v1 Container inlined with them (KServe's predictor.go)
KSERVE_MODEL_FIELDS = ("modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri", "storage")
# ComponentExtensionSpec fields inlined in the predictor beside KServe's PodSpec (component.go)
KSERVE_COMPONENT_FIELDS = ("minReplicas", "maxReplicas", "timeout", "labels", "annotations", "scaleMetric",
                           "scaleTarget", "containerConcurrency", "canaryTrafficPercent", "deploymentStrategy")


def _schema(name: str) -> dict:
    return json.loads((KSERVE / "schemas" / name).read_text())


@pytest.fixture(scope="module")
def runtime():
    return one(documents(KSERVE / "servingruntime.yaml"), "ServingRuntime")


@pytest.fixture(scope="module")
def isvc():
    return one(documents(KSERVE / "inferenceservice.yaml"), "InferenceService")


@pytest.fixture(scope="module")
def container(runtime):
    (found,) = runtime["spec"]["containers"]
    return found


def _validate(doc: dict, schema_name: str) -> None:
    jsonschema.Draft202012Validator(_schema(schema_name)).validate(doc)


def _as_pod(pod_spec: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": pod_spec}


def test_the_serving_runtime_matches_kserves_crd_and_its_containers_kubernetes(runtime):
    _validate(runtime, "servingruntime.v1alpha1.schema.json")
    pod = {k: runtime["spec"][k] for k in ("containers", "volumes", "nodeSelector", "tolerations")
           if k in runtime["spec"]}
    kubernetes_validate.validate(_as_pod(pod), K8S_VERSION, strict=True)


def test_the_inference_service_matches_kserves_crd_and_its_pod_parts_kubernetes(isvc):
    _validate(isvc, "inferenceservice.v1beta1.schema.json")
    predictor = isvc["spec"]["predictor"]
    model = {k: v for k, v in predictor["model"].items() if k not in KSERVE_MODEL_FIELDS}
    pod = {k: v for k, v in predictor.items() if k not in KSERVE_COMPONENT_FIELDS + ("model",)}
    pod["containers"] = [{"name": "kserve-container", **model}]
    kubernetes_validate.validate(_as_pod(pod), K8S_VERSION, strict=True)


@pytest.mark.parametrize("path, value, schema_name", [
    (("spec", "protocolVersions", 0), "openai", "servingruntime.v1alpha1.schema.json"),
    (("spec", "supportedModelFormats", 0, "autoselect"), True, "servingruntime.v1alpha1.schema.json"),
    (("spec", "predictor", "model", "protocolVersion"), "v3", "inferenceservice.v1beta1.schema.json"),
    (("spec", "predictor", "model", "storageURI"), "s3://b/m/", "inferenceservice.v1beta1.schema.json"),
    (("spec", "predictor", "terminationGracePeriod"), 90, "inferenceservice.v1beta1.schema.json"),
    (("metadata", "annotations", "serving.kserve.io/deploymentMode"), "Raw", "inferenceservice.v1beta1.schema.json"),
])
def test_the_schemas_refuse_what_kserve_would_not_take(runtime, isvc, path, value, schema_name):
    doc = copy.deepcopy(runtime if schema_name.startswith("serving") else isvc)
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc, schema_name)


def test_the_inference_service_selects_this_runtime(runtime, isvc):
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in [f["name"] for f in runtime["spec"]["supportedModelFormats"]]
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]


def _merged_env(container: dict, isvc: dict) -> dict[str, str]:
    """KServe merges the InferenceService's model container into the runtime's (env by name)."""
    return {**env_map(container), **env_map(isvc["spec"]["predictor"]["model"])}


def test_the_container_serves_the_inference_service_under_its_name(container, isvc, tmp_path):
    args = parse_args(container["args"])
    assert str(args.model_dir) == "/mnt/models"  # where KServe's storage initializer puts storageUri
    env = _merged_env(container, isvc)
    assert unread_names(env, tmp_path, argv_model_dir=True) == []
    server = resolve(env, tmp_path, argv_model_dir=True)
    (model,) = server.models
    assert model.name == isvc["metadata"]["name"]  # /v2/models/<name> is the InferenceService's
    assert model.unknown_options == ()
    gpus = int(isvc["spec"]["predictor"]["model"]["resources"]["limits"]["nvidia.com/gpu"])
    assert model.tensor_parallel_degree == gpus
    app = empty_app()
    adapter = app.url_map.bind("localhost")
    for path in (f"/v2/models/{model.name}/infer", f"/v2/models/{model.name}/generate", "/v1/chat/completions"):
        adapter.match(path, method="POST")  # the v2 and OpenAI routes KServe forwards by path


def test_probes_port_and_grace_period_agree_with_the_server(container, isvc, tmp_path):
    app = empty_app()
    (port,) = container["ports"]
    assert port["containerPort"] == config.ServerConfig.model_fields["port"].default
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]["httpGet"]
        assert is_get_route(app, probe["path"]) and probe["port"] == port["containerPort"], kind
    server = resolve(_merged_env(container, isvc), tmp_path, argv_model_dir=True)
    grace = isvc["spec"]["predictor"]["terminationGracePeriodSeconds"]
    assert grace > drain_budget(server.graceful_timeout, pre_stop_seconds(container))
    assert probe_budget(container["startupProbe"]) > server.models[0].model_loading_timeout
    annotations = isvc["spec"]["predictor"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]


def test_readiness_turns_unhealthy_when_the_drain_starts(container):
    assert readiness_follows_the_drain(container) == (200, 503)
