"""What the deploy/ manifests are checked against: the server's own routes, defaults and configuration
code (tests/unit/repo/test_deploy_kubernetes.py, test_deploy_kserve.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lmi_serve.config import sources as config
from lmi_serve.server import drain
from lmi_serve.server.app import create_app
from lmi_serve.serving.registry import ModelRegistry

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
BOGUS = "?not-a-valid-value?"


def documents(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def empty_app(registry: ModelRegistry | None = None):
    """The real Flask app with no model: its URL map and health routes, without loading anything."""
    server = config.ServerConfig.model_construct(max_request_size=1, request_id_header="x-request-id",
                                                 triton_server_name="triton", models=())
    return create_app(server, registry or ModelRegistry([]))


def is_get_route(app, path: str) -> bool:
    try:
        app.url_map.bind("localhost").match(path, method="GET")
    except Exception:
        return False
    return True


def env_map(container: dict[str, Any]) -> dict[str, str]:
    assert all("value" in e for e in container.get("env", [])), "plain values only: the test resolves them"
    return {e["name"]: e["value"] for e in container.get("env", [])}


def resolve(env: dict[str, str], model_dir: Path, argv_model_dir: bool = False) -> config.ServerConfig:
    """lmi-serve's configuration for this environment, the weights in `model_dir` (a folder with a
    config.json): passed as --model-dir (`argv_model_dir`) or found where SageMaker and the Deployment
    mount them (/opt/ml/model)."""
    (model_dir / "config.json").write_text("{}")
    if argv_model_dir:
        return config.build_server_config(env, model_dir=model_dir)
    saved = config.SAGEMAKER_MODEL_DIR
    config.SAGEMAKER_MODEL_DIR = model_dir
    try:
        return config.build_server_config(env)
    finally:
        config.SAGEMAKER_MODEL_DIR = saved


def unread_names(env: dict[str, str], model_dir: Path, argv_model_dir: bool = False) -> list[str]:
    """The names in `env` lmi-serve does not read: for each, an invalid value must stop the
    configuration with an error naming it (config/sources.py fails fast naming the key as written). A name that
    takes any text (HF_MODEL_ID) cannot be shown read this way: check where its value lands instead."""
    unread = []
    for name in env:
        try:
            resolve({**env, name: BOGUS}, model_dir, argv_model_dir)
        except config.ConfigError as exc:
            if str(exc).startswith(name):
                continue
        unread.append(name)
    return unread


def drain_budget(graceful_timeout: float, pre_stop_seconds: float) -> float:
    """Seconds from the kubelet's SIGTERM until lmi-serve has surely exited: the preStop hook runs
    first, then the drain's timeout, then the master's hard stop after its margin (drain.py)."""
    return pre_stop_seconds + graceful_timeout + drain.HARD_STOP_MARGIN


def pre_stop_seconds(container: dict[str, Any]) -> float:
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"a preStop the test cannot time: {command}"
    return float(command[1])


def probe_budget(probe: dict[str, Any]) -> int:
    """Seconds a failing probe is tolerated before the kubelet acts (defaults per the Kubernetes API)."""
    return probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10)


def readiness_follows_the_drain(container: dict[str, Any]) -> tuple[int, int]:
    """What `container`'s readiness probe path answers on an app with no model: (serving, once SIGTERM
    came), drain.py setting the registry's `stopping`. A probe fit for the drain reads (200, 503)."""
    registry = ModelRegistry([])
    client = empty_app(registry).test_client()
    path = container["readinessProbe"]["httpGet"]["path"]
    serving = client.get(path).status_code
    registry.stopping = True
    return serving, client.get(path).status_code
