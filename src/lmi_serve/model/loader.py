"""Locate a model (local dir, GGUF file, PyPI-packaged files, or cached hub id) and load it.

transformers is never let download (`local_files_only`): Hub and S3 models are fetched before they
load (model/download.py, in ModelService.load), and reach here as local folders.

GGUF parsing in transformers is slow (three pure-Python passes, ~30 s for a 135M model), so a GGUF model
is converted once into a safetensors folder under the cache dir; later starts load that in ~2 s.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmi_serve.model.cache_folder import built_once

# Where the files are lives in source.py (torch-free); these names stay importable from here.
from lmi_serve.model.source import ModelLoadError, find_gguf, resolve_model_source

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Placement:
    """Where and in which precision the weights go."""

    dtype: torch.dtype
    device_map: str | dict[str, Any] | None
    device: torch.device
    max_memory: dict[int, str] | None = None


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    device: torch.device
    source: str
    load_seconds: float
    # A vision-language model's processor (model/task.py VISION_ARCHITECTURES): it turns images into
    # the model's pixel tensors and expands the prompt's image placeholders; None for a text model.
    processor: Any = None


# config.json's `torch_dtype` (`dtype` in transformers >= 4.56) -> our name, where option.dtype=auto follows it
_CHECKPOINT_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
BF16_CAPABILITY = (8, 0)  # Ampere: the first compute capability with bf16 tensor cores (T4 and V100 only emulate it)


def checkpoint_dtype(config: Any) -> str | None:
    """The dtype a checkpoint declares in config.json (`dtype`, or the older `torch_dtype`) as `fp16`,
    `bf16` or `fp32`; None when it declares none, or another (an fp8 or quantized checkpoint)."""
    for name in ("dtype", "torch_dtype"):
        value = getattr(config, name, None)
        if value is not None:
            return _CHECKPOINT_DTYPES.get(str(value).removeprefix("torch."))
    return None


def gpu_bf16(gpus: int) -> tuple[bool, str]:
    """Whether every visible GPU computes bf16 natively (compute capability >= 8.0), not by emulation as
    `torch.cuda.is_bf16_supported()` counts by default; and the GPUs' description for the log."""
    if getattr(torch.version, "hip", None):  # ROCm: no CUDA compute capability; torch knows
        return bool(torch.cuda.is_bf16_supported()), "ROCm GPU"
    capabilities = sorted({torch.cuda.get_device_capability(i) for i in range(gpus)})
    lowest = capabilities[0]
    shown = ", ".join(f"{major}.{minor}" for major, minor in capabilities)
    return tuple(lowest) >= BF16_CAPABILITY, f"compute capability {shown}"


def choose_dtype(dtype: str, gpus: int, declared: str | None) -> tuple[torch.dtype, str]:
    """The weights' dtype and why, for `option.dtype` on `gpus` visible GPUs (0: the CPU) and a checkpoint
    that declares `declared` (checkpoint_dtype).

    CPU: `auto` is fp32, the exact default. `bf16` is an opt-in: fast where the CPU computes bf16 in hardware
    (avx512_bf16 or AMX: its Linear layers then run on oneDNN, kernels/layers/linear_kernels.py), emulated and slower
    elsewhere, and never exact.
    GPU: `auto` follows the checkpoint (fp16, bf16 or fp32; fp16, DJL LMI's default, when it declares
    none), except bf16 on a GPU below compute capability 8.0, which only emulates it: fp16 there."""
    if dtype in _DTYPES:
        if dtype == "bf16" and gpus:
            native, gpu = gpu_bf16(gpus)
            if not native:
                return torch.bfloat16, f"option.dtype=bf16, though this GPU ({gpu}) only emulates bf16 (slower than fp16)"
        if dtype == "bf16" and not gpus:
            from lmi_serve.kernels.host import bf16_native

            how = ("computed in hardware (avx512_bf16/AMX) on oneDNN" if bf16_native()
                   else "though this CPU only emulates bf16 (no avx512_bf16 or AMX): slower than fp32")
            return torch.bfloat16, f"option.dtype=bf16 on a CPU, {how}; not exact (fp32 is the default)"
        return _DTYPES[dtype], f"option.dtype={dtype}"
    if not gpus:
        return torch.float32, "option.dtype=auto on a CPU: fp32, exact (option.dtype=bf16 is the faster opt-in)"
    if declared is None:
        return torch.float16, "option.dtype=auto on a GPU; the checkpoint declares no fp16/bf16/fp32 dtype (fp16 as DJL LMI)"
    if declared == "bf16":
        native, gpu = gpu_bf16(gpus)
        if not native:
            return torch.float16, (f"option.dtype=auto: the checkpoint is bf16, but this GPU ({gpu}) only emulates "
                                   "bf16 (native from 8.0): fp16")
        return torch.bfloat16, f"option.dtype=auto: the checkpoint's bf16 ({gpu})"
    return _DTYPES[declared], f"option.dtype=auto: the checkpoint's {declared}"


def choose_placement(dtype: str, device_map: str | None, tensor_parallel_degree: int | str,
                     rank: int = 0, declared_dtype: str | None = None) -> Placement:
    """The weights' dtype (choose_dtype; logged with its reason by rank 0) and device.

    tensor_parallel_degree > 1 (or `max`: every GPU) shards the model over that many ranks (model/tp.py):
    rank r computes on `cuda:r`, or on the CPU. `device_map` (accelerate's layer spreading, for
    models without a tensor-parallel plan) is the other way to use several GPUs, never both.
    The GPUs are this worker's own: the server gives each worker its group (CUDA_VISIBLE_DEVICES,
    server/gpus.py), so `cuda:0` is its first GPU.
    """
    from lmi_serve.model.tp import resolve_degree

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    torch_dtype, why = choose_dtype(dtype, gpus, declared_dtype)
    if rank == 0:
        log.info("Weights in %s: %s", str(torch_dtype).removeprefix("torch."), why)
    tp = resolve_degree(tensor_parallel_degree, gpus)
    if tp > 1 and device_map:
        raise ModelLoadError(f"tensor_parallel_degree={tp} and device_map={device_map!r} both place the model; "
                             "use one of them")
    if not gpus:
        if device_map not in (None, "cpu", "auto"):
            raise ModelLoadError(f"device_map {device_map!r} needs a GPU, and none is visible")
        return Placement(torch_dtype, None, torch.device("cpu"))
    if tp > gpus:
        raise ModelLoadError(f"tensor_parallel_degree={tp} but only {gpus} GPU(s) are visible to this worker")
    if tp > 1:
        return Placement(torch_dtype, None, torch.device("cuda", rank))  # transformers places the shards
    if device_map:
        return Placement(torch_dtype, device_map, torch.device("cuda:0"))
    return Placement(torch_dtype, {"": 0}, torch.device("cuda:0"))


def _gguf_cache_folder(cache_dir: str, gguf: Path) -> Path:
    """The conversion's folder: keyed by the file's bytes and the transformers version that converts it.

    Not by path or mtime: an image layer or a copy changes those while the conversion stays valid, and a
    different file of the same name and size must never reuse it. Hashing 98 MB takes ~0.1 s (SHA-NI),
    against ~20 s for a conversion.
    """
    import transformers

    content = hashlib.sha256()
    with open(gguf, "rb") as file:
        while chunk := file.read(1 << 20):
            content.update(chunk)
    key = f"{content.hexdigest()}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "gguf" / f"{gguf.stem}-{digest}"


def convert_gguf(gguf: Path, cache_dir: str) -> Path:
    """Dequantize a GGUF once into a safetensors folder (fp32) and return that folder.

    A file lock makes concurrent starts wait for one conversion instead of racing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _gguf_cache_folder(cache_dir, gguf)

    def build(staging: Path) -> None:
        log.info("Converting GGUF %s to safetensors in %s (one time; later starts load the copy)", gguf, target)
        started = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        log.info("GGUF conversion: tokenizer parsed in %.1f s", time.monotonic() - started)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        log.info("GGUF conversion: weights dequantized in %.1f s", time.monotonic() - started)
        # The weights are plain floats now; the gguf quantizer marker only blocks save_pretrained.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        log.info("GGUF conversion: done in %.1f s", time.monotonic() - started)

    return built_once(target, build)


def _pretrained_kwargs(revision: str | None, trust_remote_code: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    if revision:
        kwargs["revision"] = revision
    return kwargs


def _explain(source: str, exc: Exception) -> ModelLoadError:
    if not Path(source).exists():
        return ModelLoadError(
            f"model {source!r} is neither a local path nor in the local Hugging Face cache, and the loader "
            f"never downloads (the server fetches Hub ids at start-up): put the files in a folder and point "
            f"option.model_id at it ({exc})")
    return ModelLoadError(f"could not load {source}: {exc}")


def _sharding(config: Any, tensor_parallel_degree: int | str) -> dict[str, Any]:
    """from_pretrained's arguments for tensor parallelism: none for one rank; else transformers' plan
    over the process group this rank has joined (model/tp.py), after checking the model has one."""
    from lmi_serve.model.tp import check_tp_plan, resolve_degree

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    degree = resolve_degree(tensor_parallel_degree, gpus)
    if degree <= 1:
        return {}
    check_tp_plan(config, degree)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() != degree:
        raise ModelLoadError(f"tensor_parallel_degree={degree}: this process is not in a group of {degree} ranks")
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=degree)}


def four_bit_source(model_id: str, gguf_file: str | None, loaded_source: str) -> Path | None:
    """The file whose quantized weights option.quantize=q4 runs: the GGUF `model_id` names, else the block file
    a pre-quantized checkpoint's dequantized folder (`loaded_source`, LoadedModel.source) holds; None if neither."""
    from lmi_serve.kernels.layers.block_file import NAME

    gguf = find_gguf(resolve_model_source(model_id), gguf_file)
    if gguf is not None:
        return gguf
    blocks = Path(loaded_source) / NAME
    return blocks if blocks.is_file() else None


def load_generation_model(model_id: str, *, gguf_file: str | None = None, dtype: str = "auto",
                   device_map: str | None = None, tensor_parallel_degree: int | str = 1,
                   revision: str | None = None, trust_remote_code: bool = False,
                   cache_dir: str = "~/.cache/lmi-serve") -> LoadedModel:
    """Load a text-generation model and its tokenizer, in eval mode, placed per `choose_placement`:
    a causal LM, or a seq2seq LM (with its encoder) when the config is encoder-decoder (T5, BART),
    whatever task brought it here: as a causal LM, BART would lose its encoder and T5 not load.
    A vision-language model of a served family loads with its vision tower and its processor
    (`LoadedModel.processor`, whose tokenizer is the tokenizer); one of another family is refused."""
    from transformers import AutoConfig, AutoTokenizer

    started = time.monotonic()
    source = resolve_model_source(model_id)
    gguf = find_gguf(source, gguf_file)
    if gguf is not None:
        source = str(convert_gguf(gguf, cache_dir))
    else:  # AWQ / GPTQ / compressed-tensors load dequantized; other quantization_configs are refused here
        from lmi_serve.model.quantized.convert import dequantize_if_quantized

        source = dequantize_if_quantized(source, cache_dir)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    kwargs = _pretrained_kwargs(revision, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
        auto, processor = _model_class(source, config, kwargs)
        tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(source, **kwargs)
        placement = choose_placement(dtype, device_map, tensor_parallel_degree, rank, checkpoint_dtype(config))
        kwargs.update(_sharding(config, tensor_parallel_degree))
        model = auto.from_pretrained(source, config=config, dtype=placement.dtype, device_map=placement.device_map,
                                     max_memory=placement.max_memory, **kwargs)
    except (OSError, ValueError) as exc:
        raise _explain(source, exc) from exc
    if placement.device_map is None:
        model.to(placement.device)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    seconds = time.monotonic() - started
    log.info("Loaded %s (%s, %s) in %.1f s", source, type(model).__name__, placement.dtype, seconds)
    return LoadedModel(model, tokenizer, placement.device, source, seconds, processor)


def _model_class(source: str, config: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(transformers auto class, processor or None) for a generation checkpoint's `config`."""
    import transformers

    from lmi_serve.model.task import vision_decision

    vision = vision_decision(tuple(getattr(config, "architectures", None) or ()), getattr(config, "model_type", None))
    if vision is not None and vision.refused:
        raise ModelLoadError(vision.refused)
    if vision is not None:
        return transformers.AutoModelForImageTextToText, transformers.AutoProcessor.from_pretrained(source, **kwargs)
    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM, None
    return transformers.AutoModelForCausalLM, None


def load_encoder(model_id: str, *, dtype: str = "auto", device_map: str | None = None,
                 revision: str | None = None, trust_remote_code: bool = False,
                 head: str = "AutoModel") -> LoadedModel:
    """Load an encoder (e.g. MiniLM): the base model without a head for embeddings, or with the head
    transformers' auto class `head` names (AutoModelForSequenceClassification: rerankers, classifiers)."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    auto_class = getattr(transformers, head)

    started = time.monotonic()
    source = resolve_model_source(model_id)
    kwargs = _pretrained_kwargs(revision, trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        config = AutoConfig.from_pretrained(source, **kwargs)
        placement = choose_placement(dtype, device_map, 1, declared_dtype=checkpoint_dtype(config))
        model = auto_class.from_pretrained(source, config=config, dtype=placement.dtype,
                                           device_map=placement.device_map, **kwargs)
    except (OSError, ValueError) as exc:
        raise _explain(source, exc) from exc
    if placement.device_map is None:
        model.to(placement.device)
    model.eval()
    seconds = time.monotonic() - started
    log.info("Loaded encoder %s (%s) in %.1f s", source, placement.dtype, seconds)
    return LoadedModel(model, tokenizer, placement.device, source, seconds)
