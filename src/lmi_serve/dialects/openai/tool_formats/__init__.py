"""Tool-call formats by family, and which one a model uses.

`option.tool_call_parser` names one (vLLM's names); otherwise the chat template tells, by the
markers it writes: `[TOOL_CALLS]` Mistral, a pythonic call example Llama 3.2/4 pythonic,
`<function=` Qwen3-Coder XML, `<|channel|>` gpt-oss harmony (`openai`), `<|tool_call>call:` Gemma 4,
`<｜tool▁calls▁begin｜>`
DeepSeek (V3/R1 when the template fences the arguments in ```json, else V3.1), `<|tool_call|>` Granite,
`<tool_call>` Hermes/Qwen, `<|python_tag|>` or the `"parameters"` call format Llama 3.x JSON.
A template with none of them (or none at all) gets Hermes, the format most open models follow.
"""

from __future__ import annotations

from lmi_serve.dialects.openai.tool_formats.base import Call, Scan, ToolFormat
from lmi_serve.dialects.openai.tool_formats.deepseek import DeepSeekV3, DeepSeekV31
from lmi_serve.dialects.openai.tool_formats.gemma import Gemma4
from lmi_serve.dialects.openai.tool_formats.granite import Granite
from lmi_serve.dialects.openai.tool_formats.harmony import Harmony
from lmi_serve.dialects.openai.tool_formats.hermes import Hermes
from lmi_serve.dialects.openai.tool_formats.llama3_json import Llama3Json
from lmi_serve.dialects.openai.tool_formats.mistral import Mistral
from lmi_serve.dialects.openai.tool_formats.pythonic import Pythonic
from lmi_serve.dialects.openai.tool_formats.qwen3_coder import Qwen3Coder

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral(), Pythonic(), Qwen3Coder(),
                                                  Harmony(), DeepSeekV3(), DeepSeekV31(), Granite(), Gemma4())}
NAMES = tuple(FORMATS)
DEFAULT = FORMATS["hermes"]

# Checked in order: a Llama pythonic template also mentions the ipython environment, a Qwen
# template may quote JSON with "parameters" in its tool listing, and Qwen3-Coder's XML calls sit
# inside `<tool_call>` too. A marker that is a tuple needs all of its parts.
_MARKERS = (
    ("openai", ("<|channel|>",)),
    ("gemma4", ("<|tool_call>call:",)),
    ("deepseek_v3", (("<｜tool▁calls▁begin｜>", "```json"),)),
    ("deepseek_v31", ("<｜tool▁calls▁begin｜>",)),
    ("granite", ("<|tool_call|>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("pythonic", ("func_name1(", "[func_name(")),
    ("qwen3_coder", ("<function=",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>", '"parameters": dictionary', "\"parameters\": ' ")),
)


def detect(template) -> ToolFormat:
    """The format a chat template's text implies; Hermes when it implies none."""
    if isinstance(template, str):
        for name, markers in _MARKERS:
            if any(all(part in template for part in ((m,) if isinstance(m, str) else m)) for m in markers):
                return FORMATS[name]
    return DEFAULT


def choose(template, option: str | None) -> ToolFormat:
    """`option.tool_call_parser` when set (validated at start-up), else what the template implies."""
    return FORMATS[option] if option else detect(template)


__all__ = ["Call", "FORMATS", "NAMES", "Scan", "ToolFormat", "choose", "detect"]
