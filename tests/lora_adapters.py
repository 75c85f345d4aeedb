"""Small PEFT LoRA adapters built at test time (no download), and PEFT's own generation as the reference.

An adapter is PEFT's `LoraConfig` on attention projections with every lora_A and lora_B weight drawn
from a fixed seed (lora_B non-zero, unlike PEFT's initialisation), so the adapted model's greedy
output differs visibly from the base model's; `save_pretrained` writes the folder a server reads.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# name -> (seed, LoraConfig keywords): two shapes of adapter, so both code paths are exercised
ADAPTERS = {
    "alpha": (1, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
    "beta": (2, {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                 "use_rslora": True}),
    "gamma": (3, {"r": 4, "lora_alpha": 4, "target_modules": ["k_proj", "o_proj"]}),
    "wide": (4, {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}),  # over a max_lora_rank of 4
}


def build_adapter(base_model, folder: Path, name: str, std: float = 0.1) -> Path:
    """Write adapter `name` of ADAPTERS for `base_model` (left unchanged) into `folder / name`."""
    from peft import LoraConfig, get_peft_model

    seed, options = ADAPTERS[name]
    peft_model = get_peft_model(copy.deepcopy(base_model), LoraConfig(lora_dropout=0.0, **options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if ".lora_A." in param_name or ".lora_B." in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    target = Path(folder) / name
    peft_model.save_pretrained(str(target))
    return target


def peft_generate(base_model, adapter_dir: Path | None, prompt_ids: list[list[int]], max_new_tokens: int,
                  pad_id: int, eos: bool = True) -> list[list[int]]:
    """Greedy tokens PEFT's `PeftModel` (or the plain model, with no adapter) generates for each prompt alone."""
    from peft import PeftModel

    model = copy.deepcopy(base_model)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    outputs = []
    with torch.no_grad():
        for ids in prompt_ids:
            input_ids = torch.tensor([ids])
            extra = {} if eos else {"eos_token_id": None}
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id,
                                 min_new_tokens=0 if eos else max_new_tokens, **extra)
            outputs.append(out[0, len(ids):].tolist())
    return outputs
