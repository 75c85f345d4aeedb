"""A tiny Llama (2 layers, hidden 64, random weights) with SmolLM2's real tokenizer and chat template, as
the files of a Hub repo or an S3 prefix: what the download tests serve. ~13 MB, loads in a second."""

from __future__ import annotations

import io
import json
import tempfile
from functools import lru_cache
from pathlib import Path

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}


@lru_cache(maxsize=None)
def tiny_llama_files(seed: int = 0) -> dict[str, bytes]:
    """{path: content} of a loadable safetensors model folder, built from SmolLM2's config."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tp_model import smollm2_folder

    source = smollm2_folder()
    config = json.loads((source / "config.json").read_text())
    config.update(TINY)
    config.pop("quantization_config", None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(str(source)).save_pretrained(folder)
        return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}


def as_mistral(files: dict[str, bytes]) -> dict[str, bytes]:
    """The same weights declared as a Mistral model (same tensor names): a revision that `/models/<m>`
    tells apart by its architectures."""
    config = json.loads(files["config.json"])
    config.update({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None})
    return {**files, "config.json": json.dumps(config).encode()}


def pickled_only(files: dict[str, bytes]) -> dict[str, bytes]:
    """The model with its weights as a pickled `pytorch_model.bin` instead of safetensors."""
    import torch
    from safetensors.torch import load

    buffer = io.BytesIO()
    torch.save(load(files["model.safetensors"]), buffer)
    rest = {k: v for k, v in files.items() if k != "model.safetensors"}
    return {**rest, "pytorch_model.bin": buffer.getvalue()}


def with_extras(files: dict[str, bytes]) -> dict[str, bytes]:
    """The model plus what a real repo also holds and the server must not fetch."""
    return {**files, "README.md": b"# tiny\n", "onnx/model.onnx": b"onnx" * 100, "flax_model.msgpack": b"flax" * 100,
            "tf_model.h5": b"h5" * 100, "training_args.bin": b"pickle" * 10}
