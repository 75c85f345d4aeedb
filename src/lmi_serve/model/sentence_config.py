"""What a sentence-transformers checkpoint declares about its vectors, read from its own files.

An embedding model's folder says how its token states become one vector: `modules.json` lists the
modules in order (`Transformer`, `Pooling`, optional `Dense` layers, optional `Normalize`), each with
a config in its own folder; `sentence_bert_config.json` holds the Transformer module's
`max_seq_length` and `do_lower_case`; `config_sentence_transformers.json` the named `prompts` and
`default_prompt_name`. `read_sentence_config` turns them into one frozen `SentenceConfig` that the
embedding handler applies (model/pooling.py).

These files are read here rather than by loading `sentence_transformers` at run time: the package
brings scikit-learn and scipy into the image for four small JSON files and one Linear layer, and its
`encode()` would batch, pad and tokenize on its own terms, outside the server's dynamic batching and
token budget. The package stays the test reference (tests/unit/serving/test_embedding_zoo.py).

A folder without `modules.json` keeps lmi-serve's long-standing default (mean pooling, then L2
normalisation: all-MiniLM-L6-v2's pipeline). A module or setting this reader does not implement fails
the load with one line naming it: a model is never served with a vector its authors did not define.
Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmi_serve.model.source import ModelLoadError

# Pooling modes, in the order sentence-transformers concatenates them when several booleans are on.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                     "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# torch.nn activations a Dense module may name (class names of torch.nn with no required argument)
DENSE_ACTIVATIONS = ("Identity", "Tanh", "Sigmoid", "ReLU", "GELU", "SiLU", "Softplus", "LeakyReLU", "ELU", "Mish")
_KNOWN_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")


@dataclass(frozen=True)
class DenseLayer:
    """One `Dense` module: `activation(linear(x))`, plus `x` (or `residual(x)`) with `use_residual`."""

    folder: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # one of DENSE_ACTIVATIONS
    use_residual: bool = False


@dataclass(frozen=True)
class SentenceConfig:
    """How one checkpoint's token states become its vector, and how its texts are prepared."""

    modes: tuple[str, ...] = ("mean",)  # concatenated in this order
    include_prompt: bool = True  # False: a prompt's tokens are left out of the pooling
    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = True
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    declared: bool = False  # False: no modules.json, lmi-serve's default pipeline

    def dimension(self, hidden_size: int) -> int:
        """The length of the vectors this pipeline gives for a transformer of width `hidden_size`."""
        return self.dense[-1].out_features if self.dense else hidden_size * len(self.modes)

    def prompt(self, name: str | None) -> str:
        """The text put before each input for prompt `name` (None: the default prompt, if any)."""
        if name is None:
            return self.prompts.get(self.default_prompt_name, "") if self.default_prompt_name else ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise ValueError(f"prompt_name {name!r} is not one of this model's prompts ({known})")
        return self.prompts[name]

    def describe(self) -> str:
        """One line for the load log."""
        parts = ["+".join(self.modes) + " pooling" + ("" if self.include_prompt else " (prompt excluded)")]
        parts += [f"Dense {d.in_features}->{d.out_features} {d.activation}" for d in self.dense]
        parts.append("normalised" if self.normalize else "not normalised")
        if self.prompts:
            parts.append(f"prompts {sorted(self.prompts)} (default {self.default_prompt_name})")
        return ", ".join(parts) + ("" if self.declared else " (no modules.json: lmi-serve's default)")


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value


def _modes(config: dict[str, Any], where: Path) -> tuple[str, ...]:
    """The pooling modes a Pooling config turns on: `pooling_mode` (a name or a list, sentence-transformers
    v5 and later) or the older `pooling_mode_*` booleans; mean when none is on, as sentence-transformers does."""
    declared = config.get("pooling_mode")
    if declared is None:
        names = tuple(mode for key, mode in _LEGACY_MODE_KEYS.items() if config.get(key))
    else:
        names = (declared,) if isinstance(declared, str) else tuple(declared)
    unknown = [m for m in names if m not in POOLING_MODES]
    if unknown:
        raise ModelLoadError(f"{where}: pooling mode {unknown[0]!r} is not one of {', '.join(POOLING_MODES)}")
    return names or ("mean",)  # concatenated in this order: the booleans' fixed one, or the list's own


def _pooling(folder: Path) -> tuple[tuple[str, ...], bool]:
    config = _json(folder / "config.json")
    include_prompt = config.get("include_prompt", True)
    if not isinstance(include_prompt, bool):
        raise ModelLoadError(f"{folder / 'config.json'}: include_prompt must be true or false")
    return _modes(config, folder / "config.json"), include_prompt


def _dense(folder: Path) -> DenseLayer:
    where = folder / "config.json"
    config = _json(where)
    activation = str(config.get("activation_function") or "torch.nn.modules.activation.Tanh")
    name = activation.rsplit(".", 1)[-1]
    if not activation.startswith("torch.nn.") or name not in DENSE_ACTIVATIONS:
        raise ModelLoadError(f"{where}: Dense activation {activation!r} is not supported "
                             f"(supported: torch.nn {', '.join(DENSE_ACTIVATIONS)})")
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in (None, "sentence_embedding"):
            raise ModelLoadError(f"{where}: Dense {key} {config[key]!r} is not supported: only a Dense layer on the "
                                 "pooled sentence embedding is")
    if not any((folder / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")):
        raise ModelLoadError(f"{folder}: the Dense module has no weights (model.safetensors or pytorch_model.bin)")
    try:
        return DenseLayer(folder, int(config["in_features"]), int(config["out_features"]),
                          bool(config.get("bias", True)), name, bool(config.get("use_residual", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: a Dense config needs integer in_features and out_features ({exc})") from None


def _transformer_settings(root: Path, path: str) -> tuple[int | None, bool]:
    if path not in ("", "."):
        raise ModelLoadError(f"{root / 'modules.json'}: the Transformer module is in the subfolder {path!r}; "
                             "lmi-serve loads the transformer from the model's root folder (re-save the model with "
                             "a current sentence-transformers)")
    settings_file = root / "sentence_bert_config.json"
    settings = _json(settings_file) if settings_file.is_file() else {}
    task = settings.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ModelLoadError(f"{settings_file}: transformer_task {task!r} is not supported (only feature-extraction: "
                             "token states from the model's forward)")
    modalities = settings.get("modality_config") or {}
    if "message" in modalities:
        raise ModelLoadError(f"{settings_file}: modality_config declares a 'message' modality (texts rendered through "
                             "the chat template before embedding), which lmi-serve's embedding handler does not "
                             "implement")
    if settings.get("module_output_name", "token_embeddings") != "token_embeddings":
        raise ModelLoadError(f"{settings_file}: module_output_name {settings['module_output_name']!r} is not "
                             "supported (only token_embeddings)")
    max_seq_length = settings.get("max_seq_length")
    if max_seq_length is not None and (not isinstance(max_seq_length, int) or max_seq_length < 1):
        raise ModelLoadError(f"{settings_file}: max_seq_length must be a positive integer")
    return max_seq_length, bool(settings.get("do_lower_case", False))


def _prompts(root: Path) -> tuple[dict[str, str], str | None]:
    path = root / "config_sentence_transformers.json"
    config = _json(path) if path.is_file() else {}
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ModelLoadError(f"{path}: prompts must map names to texts")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ModelLoadError(f"{path}: default_prompt_name {default!r} is not one of its prompts")
    return dict(prompts), default


def read_sentence_config(folder: str | Path) -> SentenceConfig:
    """The pipeline `folder` declares; lmi-serve's default where it has no `modules.json`."""
    root = Path(folder)
    prompts, default_prompt = _prompts(root)
    listing = root / "modules.json"
    if not listing.is_file():
        return SentenceConfig(prompts=prompts, default_prompt_name=default_prompt)
    try:
        modules = json.loads(listing.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{listing}: cannot be read as JSON ({exc})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{listing}: expected a list of modules")
    kinds = [_kind(m, listing) for m in modules]
    if not kinds or kinds[0] != "Transformer":
        raise ModelLoadError(f"{listing}: the first module must be a Transformer, not {kinds[:1] or 'nothing'}")
    max_seq_length, lower = _transformer_settings(root, str(modules[0].get("path", "")))
    modes, include_prompt, dense, normalize = ("mean",), True, [], False
    order = kinds[1:]
    if order[:1] == ["Pooling"]:
        modes, include_prompt = _pooling(root / modules[1]["path"])
    else:
        raise ModelLoadError(f"{listing}: a Pooling module must follow the Transformer (found {order[:1] or 'none'})")
    for module, kind in zip(modules[2:], order[1:]):
        if normalize:
            raise ModelLoadError(f"{listing}: a {kind} module after Normalize is not supported")
        if kind == "Dense":
            dense.append(_dense(root / module["path"]))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(f"{listing}: a second {kind} module is not supported")
    return SentenceConfig(modes, include_prompt, tuple(dense), normalize, max_seq_length, lower, prompts,
                          default_prompt, declared=True)


def _kind(module: dict[str, Any], listing: Path) -> str:
    """`Transformer`, `Pooling`, `Dense` or `Normalize` (older `sentence_transformers.models.X` and newer
    module paths alike); a ModelLoadError naming any other module."""
    kind = str(module.get("type", ""))
    name = kind.rsplit(".", 1)[-1]
    if not kind.startswith("sentence_transformers.") or name not in _KNOWN_MODULES:
        raise ModelLoadError(f"{listing}: module {kind or module} is not supported by lmi-serve's embedding handler "
                             f"(it implements {', '.join(_KNOWN_MODULES)}); serving the model without it would give "
                             "vectors its authors did not define")
    if name != "Transformer" and not isinstance(module.get("path"), str):
        raise ModelLoadError(f"{listing}: module {kind} has no path")
    return name
