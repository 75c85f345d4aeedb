"""The tiny-model store of the OpenAI and Anthropic dialects' tests (tests/integration/dialects/conftest.py
serves it once for the session): its model names and options, and how its reasoning model is built."""

from __future__ import annotations

import json
from pathlib import Path

from server_process import FIXTURES

REASONER = "tiny"  # a tiny random Llama with the R1-distill chat template (test_openai_reasoning.py)
REASONING_BUDGET = 3  # its option.max_reasoning_tokens
TOOL_PARSER = "llama-json"  # SmolLM2 with option.tool_call_parser=llama3_json (test_tool_call_parser.py)
TEMPLATED = "templated"  # SmolLM2 with option.chat_template=operator.jinja (in its folder) and
# option.trust_request_chat_template=true (test_chat_template.py)
OPERATOR_TEMPLATE = ("{% for m in messages %}<<operator>> {{ m.role }}: {{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<<operator>> assistant:{% endif %}")
VLMS = {"smolvlm": "idefics3", "llava": "llava"}  # served name -> tests/tiny_vlm.py family; `llava` has
# option.limit_mm_per_prompt=image=2 (test_openai_vision.py)


def write_reasoner(folder: Path) -> None:
    """SmolLM2's vocabulary plus `<think>` / `</think>` (added, not special, as the R1 distills and
    Qwen3 have them), the real DeepSeek-R1-Distill-Qwen template, random seeded weights."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tp_model import smollm2_folder

    smollm2 = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = (FIXTURES / "chat_templates" / "deepseek_r1_distill_qwen.jinja").read_text()
    tokenizer.save_pretrained(folder)
    config = json.loads((smollm2 / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer))
    config.pop("quantization_config", None)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})).save_pretrained(folder)
    (folder / "serving.properties").write_text(
        f"option.linear_kernel=torch\noption.max_reasoning_tokens={REASONING_BUDGET}\n")
