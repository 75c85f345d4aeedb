"""Every checkpoint in the zoo (tests/tiny_embedders.py) is embedded as its sentence-transformers files
declare: each vector at cosine >= 0.99999 to `SentenceTransformer(folder).encode()`, alone and in mixed
batches of inputs of other lengths, prompts and requests. Modules the handler does not implement fail
the load naming them."""

from __future__ import annotations

import functools

import pytest
import torch

from lmi_serve.model.sentence_config import read_sentence_config
from lmi_serve.model.source import ModelLoadError
from lmi_serve.serving.handler_loader import load_handler
from lmi_serve.serving.handler_protocol import typed_from_properties
from tiny_embedders import QUERY_PROMPT, ZOO, with_module, write

COSINE = 0.99999
TEXTS = ["Hello World", "What is the capital of France?",
         "The quick brown fox jumps over the lazy dog near the river bank, then runs far into the hills beyond it.",
         "a"]


@pytest.fixture(scope="module")
def handler_module():
    module, _ = load_handler("embedding-zoo-under-test", None, None, "text-embedding")
    return module


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    return {name: write(root / name, name, seed=i) for i, name in enumerate(ZOO)}


@functools.lru_cache(maxsize=None)
def _service(handler_module, folder):
    config, _ = typed_from_properties({"model_id": str(folder)}, "text-embedding")
    return handler_module.EmbeddingService(config)


def service_for(handler_module, folder):
    """One loaded service per checkpoint for the module (a load is most of a test's time)."""
    return _service(handler_module, folder)


@functools.lru_cache(maxsize=None)
def reference_model(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


def reference(folder, texts, **kwargs) -> torch.Tensor:
    return torch.as_tensor(reference_model(folder).encode(texts, convert_to_numpy=True, **kwargs))


def assert_close(served, expected) -> None:
    served = torch.tensor(served, dtype=torch.float32)
    assert served.shape == expected.shape
    cosine = torch.nn.functional.cosine_similarity(served, expected.float(), dim=-1)
    assert cosine.min().item() >= COSINE, cosine
    # not only the direction: the length too (a checkpoint without Normalize serves unnormalised vectors)
    torch.testing.assert_close(served.norm(dim=-1), expected.float().norm(dim=-1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(ZOO))
def test_vectors_are_the_checkpoints_own_alone_and_in_mixed_batches(handler_module, zoo, name):
    folder = zoo[name]
    service = service_for(handler_module, folder)
    expected = reference(folder, TEXTS)
    alone = [service.embed([t])[0] for t in TEXTS]
    assert_close(alone, expected)
    prompts = list(read_sentence_config(folder).prompts)
    requests = [handler_module.Request(TEXTS[::-1]), handler_module.Request(TEXTS[:2])]
    requests += [handler_module.Request(TEXTS, prompt_name=p) for p in prompts]
    mixed = service.embed_requests(requests)
    assert_close(mixed[0], expected.flip(0))
    assert_close(mixed[1], expected[:2])
    for p, vectors in zip(prompts, mixed[2:]):
        assert_close(vectors, reference(folder, TEXTS, prompt_name=p))


def test_the_declared_pipeline_is_what_each_checkpoint_says(zoo):
    assert read_sentence_config(zoo["cls-and-mean"]).modes == ("cls", "mean")
    assert read_sentence_config(zoo["decoder-mean-lower-cased"]).modes == ("max", "mean")  # the booleans' order
    dense = read_sentence_config(zoo["cls-dense"])
    assert [(d.in_features, d.out_features, d.activation) for d in dense.dense] == [(64, 48, "Tanh"),
                                                                                   (48, 32, "Identity")]
    assert dense.dimension(64) == 32 and read_sentence_config(zoo["cls-and-mean"]).dimension(64) == 128
    assert not read_sentence_config(zoo["max-unnormalised"]).normalize
    legacy = read_sentence_config(zoo["prompt-excluded"])
    assert (legacy.max_seq_length, legacy.include_prompt, legacy.default_prompt_name) == (24, False, "query")
    assert read_sentence_config(zoo["decoder-lasttoken"]).prompt("query") == QUERY_PROMPT


def test_a_default_prompt_applies_unless_another_is_named(handler_module, zoo):
    folder = zoo["prompt-excluded"]
    service = service_for(handler_module, folder)
    default = service.embed(TEXTS)
    assert_close(default, reference(folder, TEXTS))  # the reference applies its default prompt too
    assert_close(service.embed(TEXTS, prompt_name="passage"), reference(folder, TEXTS, prompt_name="passage"))
    assert_close(service.embed(TEXTS, prompt="passage: "), reference(folder, TEXTS, prompt="passage: "))
    with pytest.raises(ValueError, match="'nope' is not one of this model's prompts"):
        service.embed(TEXTS, prompt_name="nope")


def test_the_decoder_model_reads_its_eos_and_pools_its_last_token(handler_module, zoo):
    service = service_for(handler_module, zoo["decoder-lasttoken"])
    ids, skipped = service.rows(handler_module.Request(["Hello World"]))[0]
    assert ids[-1] == service.tokenizer.convert_tokens_to_ids("<|endoftext|>") and skipped == 0


def test_dimensions_truncate_and_renormalise(handler_module, zoo):
    service = service_for(handler_module, zoo["cls-dense"])
    full = torch.tensor(service.embed(TEXTS))
    short = torch.tensor(service.embed(TEXTS, dimensions=8))
    torch.testing.assert_close(short, torch.nn.functional.normalize(full[:, :8], dim=-1))
    raw = torch.tensor(service.embed(TEXTS, dimensions=8, normalize=False))
    assert raw.norm(dim=-1).max() > 1.01 or raw.norm(dim=-1).min() < 0.99  # not normalised


def test_normalize_overrides_the_checkpoint_either_way(handler_module, zoo):
    service = service_for(handler_module, zoo["max-unnormalised"])
    raw = torch.tensor(service.embed(TEXTS))
    unit = torch.tensor(service.embed(TEXTS, normalize=True))
    torch.testing.assert_close(unit, torch.nn.functional.normalize(raw, dim=-1))


@pytest.mark.parametrize("module_type", ["sentence_transformers.models.LayerNorm", "my_package.Custom"])
def test_a_module_the_handler_does_not_implement_fails_the_load_naming_it(tmp_path, zoo, module_type):
    folder = with_module(zoo["mean"], tmp_path / "odd", module_type)
    with pytest.raises(ModelLoadError, match=f"module {module_type} is not supported"):
        read_sentence_config(folder)


def test_texts_rendered_through_a_chat_template_are_refused_at_load(tmp_path, zoo):
    import json
    import shutil

    folder = shutil.copytree(zoo["mean"], tmp_path / "message")
    settings = {"transformer_task": "feature-extraction",
                "modality_config": {"text": {"method": "forward"}, "message": {"method": "forward", "format": "flat"}}}
    (folder / "sentence_bert_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelLoadError, match="'message' modality"):
        read_sentence_config(folder)
