"""Which task serves a model, decided from the model's own files.

In order:

1. ``option.task`` (``OPTION_TASK``, ``HF_TASK``) wins.
2. A sentence-transformers layout (``modules.json`` or ``sentence_bert_config.json``): text-embedding.
3. A GGUF file, or a source whose ``config.json`` cannot be read (not found, not in the Hugging Face
   cache): text-generation, as before; the loader then says what is missing.
4. ``config.json``, architecture by architecture: transformers' seq2seq-LM mapping ->
   text2text-generation; its causal-LM mapping -> text-generation; then LMI's suffix rule
   (``*ForCausalLM``, ``*LMHeadModel`` -> text-generation; ``*ForConditionalGeneration`` ->
   text2text-generation when the config is encoder-decoder, else text-generation); then models with a
   classification head (transformers' sequence-classification mapping, ``*ForSequenceClassification``:
   cross-encoder rerankers, classifiers) -> text-classification (DJL's ARCHITECTURES_2_TASK); then
   encoders without an LM head (transformers' masked-LM and base-model mappings, ``*Model``,
   ``*ForMaskedLM``) -> text-embedding. A generation task beats classification, classification beats
   embedding, and text2text beats text-generation: an encoder anywhere must not be dropped. Without
   ``architectures`` the ``model_type`` decides the same way, then a remote-code ``auto_map``.
   Before all that, a vision-language model (an architecture in transformers' image-text-to-text
   mapping and not in its causal-LM one, which holds the VLMs that also serve as text models, Gemma 3)
   of a family in `VISION_ARCHITECTURES` -> text-generation with images (loaded with its processor);
   one of another family has no task, and the refusal names the families served.
5. Nothing fits: no task. The model fails at load, unless a model.py of its own serves it.

``text2text-generation`` (T5, BART) is served by the same built-in handler and routes as
``text-generation``; ``load_generation_model`` loads an encoder-decoder checkpoint with its encoder
whatever the task says, so such a model is never loaded as a causal LM that drops its encoder.

transformers' auto mappings are imported on the first decision, not with this module (importing
them imports torch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmi_serve.model.source import ModelLoadError, find_gguf, resolve_model_source

if TYPE_CHECKING:
    from lmi_serve.config.sources import ModelConfig

TEXT_GENERATION = "text-generation"
TEXT2TEXT_GENERATION = "text2text-generation"
GENERATION_TASKS = frozenset({TEXT_GENERATION, TEXT2TEXT_GENERATION})  # both served by the text-generation routes
TEXT_EMBEDDING = "text-embedding"
TEXT_CLASSIFICATION = "text-classification"  # *ForSequenceClassification: rerankers and classifiers
ENCODER_TASKS = frozenset({TEXT_EMBEDDING, TEXT_CLASSIFICATION})  # served by dynamic batches of forwards
_PRIORITY = (TEXT2TEXT_GENERATION, TEXT_GENERATION, TEXT_CLASSIFICATION, TEXT_EMBEDDING)  # when architectures disagree
_SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json")
_AUTO_MAP_TASKS = (("AutoModelForSeq2SeqLM", TEXT2TEXT_GENERATION), ("AutoModelForCausalLM", TEXT_GENERATION),
                   ("AutoModelForSequenceClassification", TEXT_CLASSIFICATION), ("AutoModel", TEXT_EMBEDDING))
_HOW_TO_SET = "set option.task in serving.properties, or OPTION_TASK / HF_TASK in the environment"


# Vision-language families whose image rows the engine is checked to serve exactly
# (tests/unit/engine/test_vision_rows.py): architecture -> the families it is.
VISION_ARCHITECTURES = {
    "Idefics3ForConditionalGeneration": "Idefics3 / SmolVLM",
    "LlavaForConditionalGeneration": "LLaVA (1.5)",
}
SERVED_VISION = ", ".join(f"{arch} ({what})" for arch, what in VISION_ARCHITECTURES.items())


class ModelTaskError(RuntimeError):
    """No built-in handler serves the model's task; the message says why and what to set."""


@dataclass(frozen=True)
class TaskDecision:
    """The task a model is served as (None: none fits), what it was read from, and why."""

    task: str | None
    architectures: tuple[str, ...] = ()
    reason: str = ""
    model_type: str | None = None
    images: bool = False  # a vision-language model served with its images (VISION_ARCHITECTURES)
    refused: str | None = None  # why no handler may serve it, when the task rules say more than "none fits"

    def explained(self) -> str:
        """The reason, naming the architectures (when it does not already) and the model_type."""
        words = self.reason
        if "architectures [" not in words:
            words += f"; architectures {list(self.architectures)}"
        return f"{words} (model_type {self.model_type!r})"

    def refusal(self) -> str | None:
        """Why no built-in handler may serve this model, or None when one may."""
        if self.refused:
            return self.refused
        if self.task is None:
            return (f"no task fits this model: {self.explained()}. If it generates text, set "
                    f"option.task=text-generation; if it is an encoder, option.task=text-embedding "
                    f"(or text-classification with a classification head) "
                    f"({_HOW_TO_SET}); or serve it with a model.py of your own")
        return None

    def check_builtin(self) -> None:
        """Raise ModelTaskError when a built-in handler is about to serve a model it must not."""
        problem = self.refusal()
        if problem:
            raise ModelTaskError(problem)


# --- transformers' auto mappings ---------------------------------------------------------------

@dataclass(frozen=True)
class _Mappings:
    seq2seq_names: frozenset[str]
    causal_names: frozenset[str]
    classifier_names: frozenset[str]
    masked_names: frozenset[str]
    base_names: frozenset[str]
    image_text_names: frozenset[str]  # vision-language models, less those also in the causal-LM mapping
    seq2seq_types: frozenset[str]
    causal_types: frozenset[str]
    encoder_types: frozenset[str]  # model types with a masked-LM or text-encoding class: BERT-likes


def _class_names(mapping: Any) -> frozenset[str]:
    names: set[str] = set()
    for value in mapping.values():
        names.update([value] if isinstance(value, str) else value)
    return frozenset(names)


@lru_cache(maxsize=1)
def _mappings() -> _Mappings:
    from transformers.models.auto import modeling_auto as auto

    return _Mappings(
        seq2seq_names=_class_names(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        causal_names=_class_names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        classifier_names=_class_names(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
        masked_names=_class_names(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        base_names=_class_names(auto.MODEL_MAPPING_NAMES) | _class_names(auto.MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES),
        image_text_names=_class_names(auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
        - _class_names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        seq2seq_types=frozenset(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        causal_types=frozenset(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        encoder_types=frozenset(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
        | frozenset(auto.MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES),
    )


def _architecture_task(arch: str, encoder_decoder: bool, maps: _Mappings) -> tuple[str, str] | None:
    """(task, why) for one architecture name; `why` completes "architectures [...] ..."."""
    if arch in maps.seq2seq_names:
        return TEXT2TEXT_GENERATION, "are in transformers' seq2seq-LM mapping"
    if arch in maps.causal_names:
        return TEXT_GENERATION, "are in transformers' causal-LM mapping"
    for suffix in ("ForCausalLM", "LMHeadModel"):
        if arch.endswith(suffix):
            return TEXT_GENERATION, f"end with {suffix} (LMI's suffix rule)"
    if arch.endswith("ForConditionalGeneration"):
        if encoder_decoder:
            return TEXT2TEXT_GENERATION, "end with ForConditionalGeneration and config.json is encoder-decoder"
        return TEXT_GENERATION, "end with ForConditionalGeneration and config.json is not encoder-decoder"
    if arch in maps.classifier_names:
        return TEXT_CLASSIFICATION, "are in transformers' sequence-classification mapping (rerankers, classifiers)"
    if arch.endswith("ForSequenceClassification"):
        return TEXT_CLASSIFICATION, "end with ForSequenceClassification (LMI's suffix rule: text-classification)"
    if arch in maps.masked_names:
        return TEXT_EMBEDDING, "are in transformers' masked-LM mapping (an encoder: embeddings)"
    if arch in maps.base_names:
        return TEXT_EMBEDDING, "are in transformers' base-model mapping (no LM head: embeddings)"
    for suffix in ("ForMaskedLM", "Model"):
        if arch.endswith(suffix):
            return TEXT_EMBEDDING, f"end with {suffix} (LMI's suffix rule: no LM head, embeddings)"
    return None


def _model_type_task(model_type: str | None, encoder_decoder: bool, maps: _Mappings) -> tuple[str, str] | None:
    if model_type in maps.seq2seq_types:
        return TEXT2TEXT_GENERATION, f"model_type {model_type!r} is in transformers' seq2seq-LM mapping"
    if encoder_decoder:
        return TEXT2TEXT_GENERATION, "config.json is encoder-decoder (is_encoder_decoder)"
    if model_type in maps.causal_types and model_type not in maps.encoder_types:
        return TEXT_GENERATION, f"model_type {model_type!r} is in transformers' causal-LM mapping"
    if model_type in maps.encoder_types:
        return TEXT_EMBEDDING, (f"model_type {model_type!r} is an encoder "
                                "in transformers' masked-LM or text-encoding mapping")
    return None


def vision_decision(architectures: tuple[str, ...], model_type: str | None) -> TaskDecision | None:
    """The decision for a vision-language model (served with images, or refused naming the families
    served); None when no architecture is one."""
    vision = [a for a in architectures if a in _mappings().image_text_names]
    if not vision:
        return None
    served = [a for a in vision if a in VISION_ARCHITECTURES]
    if served:
        return TaskDecision(TEXT_GENERATION, architectures, f"architectures {served} are vision-language models "
                            "(transformers' image-text-to-text mapping) of a family served with images",
                            model_type, images=True)
    return TaskDecision(None, architectures, f"architectures {vision} are vision-language models",
                        model_type, refused=f"architectures {vision} are vision-language models (transformers' "
                        f"image-text-to-text mapping) of a family not checked to serve images exactly; the "
                        f"vision-language families served are {SERVED_VISION}")


def classify_config(config: dict[str, Any]) -> TaskDecision:
    """The task a parsed config.json asks for (task None when nothing fits)."""
    maps = _mappings()
    architectures = tuple(a for a in config.get("architectures") or () if isinstance(a, str))
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    vision = vision_decision(architectures, model_type)
    if vision is not None:
        return vision
    encoder_decoder = bool(config.get("is_encoder_decoder"))
    found: dict[str, dict[str, list[str]]] = {}  # task -> why -> architectures
    for arch in architectures:
        hit = _architecture_task(arch, encoder_decoder, maps)
        if hit:
            found.setdefault(hit[0], {}).setdefault(hit[1], []).append(arch)
    for task in _PRIORITY:
        if task in found:
            reason = "; ".join(f"architectures {archs} {why}" for why, archs in found[task].items())
            return TaskDecision(task, architectures, reason, model_type)
    if not architectures:
        hit = _model_type_task(model_type, encoder_decoder, maps)
        if hit:
            return TaskDecision(hit[0], architectures, f"config.json names no architectures, and {hit[1]}",
                                model_type)
    auto_map = config.get("auto_map") if isinstance(config.get("auto_map"), dict) else {}
    for key, task in _AUTO_MAP_TASKS:
        if key in auto_map:
            return TaskDecision(task, architectures, f"config.json's auto_map names {key} (remote code)", model_type)
    what = f"architectures {list(architectures)} are" if architectures else f"model_type {model_type!r} is"
    return TaskDecision(None, architectures, f"{what} in none of transformers' causal-LM, seq2seq-LM, masked-LM, "
                        "sequence-classification or base-model mappings, and match none of LMI's suffixes "
                        "(*ForCausalLM, *LMHeadModel, *ForConditionalGeneration, *ForSequenceClassification, *Model, "
                        "*ForMaskedLM)", model_type)


# --- reading the model's files -----------------------------------------------------------------

def _model_file(source: str, name: str, revision: str | None) -> Path | None:
    """`name` in a local model folder, else in the local Hugging Face cache of a hub id; None if absent."""
    path = Path(source)
    if path.is_dir():
        return path / name if (path / name).is_file() else None
    if path.exists():
        return None  # a single file (GGUF)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, name, revision=revision)
    except Exception:  # not a valid repo id, or no cache: the loader reports the model as missing
        return None
    return Path(cached) if isinstance(cached, str) else None


def _read_config(source: str, revision: str | None) -> dict[str, Any] | None:
    path = _model_file(source, "config.json", revision)
    if path is None:
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def decide_task(config: ModelConfig) -> TaskDecision:
    """The task of one configured model (see the module docstring for the order); never raises."""
    model_id = config.model_id or config.model_dir
    try:
        source = resolve_model_source(model_id) if model_id else None
    except ModelLoadError as exc:
        return TaskDecision(config.task or TEXT_GENERATION,
                            reason=f"{'set by option.task; ' if config.task else ''}the model files are not "
                                   f"found ({exc}); loading says why")
    model_config = _read_config(source, config.revision) if source else None
    architectures = tuple(a for a in (model_config or {}).get("architectures") or () if isinstance(a, str))
    model_type = (model_config or {}).get("model_type")
    model_type = model_type if isinstance(model_type, str) else None

    if config.task:
        return TaskDecision(config.task, architectures, f"set by option.task={config.task} (or OPTION_TASK / HF_TASK)",
                            model_type)
    if source is None:
        return TaskDecision(TEXT_GENERATION, reason="no model_id: the handler loads what it serves "
                                                    "(text generation by default)")
    for name in _SENTENCE_TRANSFORMERS_FILES:
        if _model_file(source, name, config.revision) is not None:
            return TaskDecision(TEXT_EMBEDDING, architectures, f"a sentence-transformers layout ({name})", model_type)
    try:
        gguf = config.gguf_file or find_gguf(source, None)
    except ModelLoadError as exc:
        return TaskDecision(TEXT_GENERATION, architectures, f"GGUF files ({exc}); loading says why", model_type)
    if gguf:
        return TaskDecision(TEXT_GENERATION, architectures,
                            f"a GGUF file ({Path(str(gguf)).name}): transformers reads GGUF as a causal LM", model_type)
    if model_config is None:
        return TaskDecision(TEXT_GENERATION, reason=f"no readable config.json for {model_id!r} in its folder or the "
                                                    "local Hugging Face cache: text generation by default")
    return classify_config(model_config)
