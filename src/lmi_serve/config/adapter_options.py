"""Options for LoRA adapters (model/lora.py, engine/adapters.py): whether a model serves them, how many
stay resident, the largest rank and their dtype. One concern of `ModelConfig` (config/models.py
assembles them); the adapters are read from `<model_dir>/adapters/*` at start-up and through the
adapters API."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator

from lmi_serve.config.fields import Options, choice, parse_bool

# The LoRA matrices' dtype: auto = the model's.
LoraDtype = Literal["auto", "fp32", "fp16", "bf16"]


class AdapterOptions(Options):
    """LoRA adapters served on a model."""

    enable_lora: bool = Field(
        False,
        description=(
            "serve LoRA adapters on this model: every sub-folder of `<model dir>/adapters/` holding a PEFT "
            "adapter is registered at start-up under its folder's name, more through the adapters API; requests "
            "name theirs per dialect (see [LoRA adapters](models.md#lora-adapters)). Rolling batch, decoder-only "
            "models, one worker (start-up errors otherwise)"
        ),
    )
    max_loras: int = Field(
        4, ge=1,
        description=(
            "adapters resident at once; registering or requesting another evicts the least recently used one that"
            " no running row uses (read again from its folder when needed)"
        ),
    )
    max_lora_rank: int = Field(
        64, ge=1,
        description=(
            "an adapter of a larger rank is refused at registration (400; a start-up error for the adapters "
            "folder)"
        ),
    )
    lora_dtype: LoraDtype = Field(
        "auto",
        description="the LoRA matrices' dtype: `auto` (the model's), `fp32`, `fp16`, `bf16`",
    )

    @field_validator("lora_dtype", mode="before")
    @classmethod
    def _adapter_choice(cls, value: Any) -> Any:
        return choice(value, get_args(LoraDtype))

    @field_validator("enable_lora", mode="before")
    @classmethod
    def _adapter_flag(cls, value: Any) -> bool:
        return parse_bool(value)
