"""Which files of a remote model (a Hub repo, an S3 prefix) the server downloads, and what kind of
source a `model_id` names. Pure and torch-free: hub.py and s3.py list the remote files, this picks.

Picked: the top-level metadata (config, generation config, tokenizer files, chat template, weight
indexes, sentence-transformers module configs and Dense weights) and the weights of one format. Safetensors win; pickled
weights (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`: unpickling can run code) only with
`option.allow_pickled_weights`; a GGUF when `option.gguf_file` names it
(or it is the only weights file). ONNX, Flax, TensorFlow,
OpenVINO and other exports are never fetched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

from lmi_serve.model.source import ModelLoadError

S3_PREFIX = "s3://"
_METADATA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab")
_PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# A repo id: `name` or `namespace/name` (the Hub's own rule: letters, digits, `-`, `_`, `.`; no `--`, `..`)
_HUB_ID = re.compile(r"^(?:[\w][\w.-]{0,95}/)?[\w][\w.-]{0,95}$")
# sentence-transformers' module folders (`1_Pooling/config.json`): small configs the embedding task reads
_MODULE_FOLDER = re.compile(r"^\d+_[A-Za-z]+$")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # without a trailing slash; may be empty (the whole bucket)

    @property
    def url(self) -> str:
        return f"{S3_PREFIX}{self.bucket}/{self.prefix}".rstrip("/")


def parse_s3_url(model_id: str) -> S3Location | None:
    """The bucket and prefix of an `s3://bucket/prefix` model_id; None for anything else."""
    if not model_id.startswith(S3_PREFIX):
        return None
    bucket, _, prefix = model_id[len(S3_PREFIX):].partition("/")
    if not bucket:
        raise ModelLoadError(f"model_id {model_id!r}: no bucket (use s3://bucket/prefix)")
    return S3Location(bucket, prefix.strip("/"))


def looks_like_hub_id(model_id: str) -> bool:
    """Whether `model_id` (already known not to be a local path) is spelled like a Hub repo id."""
    return bool(_HUB_ID.match(model_id)) and "--" not in model_id and ".." not in model_id


def _is_metadata(path: PurePosixPath, trust_remote_code: bool) -> bool:
    top = len(path.parts) == 1
    if top and path.suffix in _METADATA_SUFFIXES:
        return True
    if top and path.suffix == ".py":
        return trust_remote_code  # remote code runs only with that option; without it, never fetched
    return len(path.parts) == 2 and bool(_MODULE_FOLDER.match(path.parts[0])) and path.suffix == ".json"


def _module_weights(paths: list[str], allow_pickled: bool) -> list[str]:
    """A sentence-transformers module folder's own weights (`2_Dense/model.safetensors`): the embedding
    handler applies them after pooling. Pickled ones only where pickled weights are allowed."""
    chosen = []
    for p in paths:
        parts = PurePosixPath(p).parts
        if len(parts) == 2 and _MODULE_FOLDER.match(parts[0]):
            if parts[1] == "model.safetensors" or (allow_pickled and parts[1] == "pytorch_model.bin"
                                                   and f"{parts[0]}/model.safetensors" not in paths):
                chosen.append(p)
    return chosen


def _prefer_model_prefix(names: list[str], prefix: str) -> list[str]:
    """`model*.safetensors` (one file or its shards) over every other top-level file of that format
    (Mistral's duplicate `consolidated.safetensors`), when the repo has them."""
    preferred = [n for n in names if n.startswith(prefix)]
    return preferred or names


def choose_files(paths: Iterable[str], *, source: str, allow_pickled: bool, gguf_file: str | None = None,
                 trust_remote_code: bool = False) -> list[str]:
    """The files to download out of a remote model's `paths` ('/'-separated, relative to its root).

    `source` names the model in errors. Raises ModelLoadError when the wanted weights are not there,
    or only pickled ones are and `allow_pickled` is off."""
    all_paths = sorted(set(paths))
    metadata = [p for p in all_paths if _is_metadata(PurePosixPath(p), trust_remote_code)]
    metadata += _module_weights(all_paths, allow_pickled)
    top_level = [p for p in all_paths if "/" not in p]
    if gguf_file:
        if gguf_file not in all_paths:
            ggufs = [p for p in all_paths if p.endswith(".gguf")]
            raise ModelLoadError(f"{source}: option.gguf_file {gguf_file!r} is not in it "
                                   f"(GGUF files there: {', '.join(ggufs) or 'none'})")
        return sorted(set(metadata) | {gguf_file})
    safetensors = [p for p in top_level if p.endswith(".safetensors")]
    if safetensors:
        return sorted(set(metadata) | set(_prefer_model_prefix(safetensors, "model")))
    pickled = [p for p in top_level if p.endswith(_PICKLED_SUFFIXES) and p != "training_args.bin"]
    if pickled:
        if not allow_pickled:
            raise ModelLoadError(
                f"{source} has only pickled weights ({', '.join(pickled[:3])}{', ...' if len(pickled) > 3 else ''}), "
                "and unpickling a file can run code: set option.allow_pickled_weights=true "
                "(OPTION_ALLOW_PICKLED_WEIGHTS) if you trust it, or use a revision with safetensors weights")
        return sorted(set(metadata) | set(_prefer_model_prefix(pickled, "pytorch_model")))
    ggufs = [p for p in top_level if p.endswith(".gguf")]
    if len(ggufs) == 1:  # as in a local folder: the only GGUF is the model
        return sorted(set(metadata) | set(ggufs))
    hint = f"; it has several GGUF files ({', '.join(ggufs[:3])}): choose one with option.gguf_file" if ggufs else ""
    raise ModelLoadError(f"{source} holds no weights lmi-serve loads (*.safetensors{hint})")
