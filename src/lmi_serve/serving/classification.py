"""What a sequence-classification head means: its labels, and the activation each API applies to its logits.

Neutral (no torch, no JSON): the classifier handler computes logits; the handler (LMI's pipeline shape),
the vLLM routes (/score, /rerank, /classify) and Triton's infer route turn them into scores with
`activate`, so every route's scores come from the one forward and the one rule.

The defaults follow their references:
- `pipeline`: transformers' TextClassificationPipeline (`function_to_apply` unset): sigmoid for one label
  or a multi-label problem, softmax for several labels.
- `classify`: vLLM's /classify: none for a regression head, sigmoid for multi-label, else sigmoid for one
  label and softmax for several.
- `score`: vLLM's /score and /rerank (sentence-transformers' CrossEncoder): the activation the checkpoint
  names (`sentence_transformers.activation_fn`, or `sbert_ce_default_activation_function`): Sigmoid, Softmax,
  or Identity for raw logits (ms-marco cross-encoders), as `CrossEncoder.predict()` applies it; any other
  fails the load naming it; else as `classify` (sigmoid of a single logit: bge-reranker).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ACTIVATIONS = ("sigmoid", "softmax", "none")
# sentence-transformers CrossEncoder activation classes -> ACTIVATIONS (CrossEncoder.predict applies them per logit)
_CROSS_ENCODER_ACTIVATIONS = {"Sigmoid": "sigmoid", "Softmax": "softmax", "Identity": "none"}


@dataclass(frozen=True)
class ClassifierHead:
    """A loaded classifier's labels (index order) and its three default activations."""

    labels: tuple[str, ...]
    pipeline_activation: str
    classify_activation: str
    score_activation: str

    @property
    def num_labels(self) -> int:
        return len(self.labels)


def _multi_label_default(num_labels: int, problem_type: str | None) -> str:
    if problem_type == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


def _named_activation(config: Mapping[str, Any]) -> str | None:
    """The activation a sentence-transformers CrossEncoder checkpoint declares, as one of ACTIVATIONS."""
    st = config.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, Mapping) else None
    name = name or config.get("sbert_ce_default_activation_function")
    if not isinstance(name, str):
        return None
    declared = _CROSS_ENCODER_ACTIVATIONS.get(name.rsplit(".", 1)[-1]) if name.startswith("torch.nn.") else None
    if declared is None:
        raise ValueError(f"the checkpoint's CrossEncoder activation {name!r} is not supported (supported: torch.nn "
                         f"{', '.join(_CROSS_ENCODER_ACTIVATIONS)}); its scores would not be the ones it defines")
    return declared


def head_from_config(config: Mapping[str, Any]) -> ClassifierHead:
    """The head a config.json (as a dict) describes; labels from id2label, else LABEL_<i>."""
    num_labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)
    id2label = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    labels = tuple(id2label.get(i, f"LABEL_{i}") for i in range(num_labels))
    problem_type = config.get("problem_type")
    default = _multi_label_default(num_labels, problem_type)
    classify = "none" if problem_type == "regression" else default
    return ClassifierHead(labels, pipeline_activation=default, classify_activation=classify,
                          score_activation=_named_activation(config) or classify)


def activate(logits: list[float], function: str) -> list[float]:
    """`function` (one of ACTIVATIONS) over one row of logits, in float64."""
    if function == "sigmoid":
        return [_sigmoid(x) for x in logits]
    if function == "softmax":
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        return [e / total for e in exps]
    if function == "none":
        return list(logits)
    raise ValueError(f"function_to_apply must be one of {list(ACTIVATIONS)}, not {function!r}")


def _sigmoid(x: float) -> float:
    # the two branches keep exp() from overflowing on large logits of either sign
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)
