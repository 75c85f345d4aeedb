"""Options for what is served: the model, where its weights come from, their dtype and placement,
and the handler that serves it. One concern of `ModelConfig` (config/models.py assembles them)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator

from lmi_serve.config.fields import FAST_CPU, NAME_PATTERN, Options, choice, parse_bool

Dtype = Literal["fp32", "fp16", "bf16", "auto"]
# text2text-generation: encoder-decoder models (T5, BART), served by the text-generation handler and routes.
# tensor: a model.py serving tensors (Triton).
Task = Literal["text-generation", "text2text-generation", "text-embedding", "text-classification", "tensor"]
_CHOICES = {"dtype": get_args(Dtype), "task": get_args(Task)}


class ModelOptions(Options):
    """The model, its weights and its handler."""

    name: str = Field(
        pattern=NAME_PATTERN,
        description="the served name (a model store always uses folder names)",
        json_schema_extra={"doc_default": "folder name"},
    )
    # Filled by the launcher; request_options' chat_template resolves a relative file against it, so it is
    # declared (and validated) before that field.
    model_dir: str | None = None
    model_id: str | None = Field(
        None,
        description=(
            "local folder, GGUF file, `package:<python_module>[/sub]`, a Hub id or `s3://bucket/prefix` "
            "(downloaded at start-up, see [Bring your own model](models.md#bring-your-own-model))"
        ),
        json_schema_extra={"doc_default": "the folder itself"},
    )
    gguf_file: str | None = Field(
        None,
        description="which GGUF file in the folder",
        json_schema_extra={"doc_default": "the only `*.gguf`"},
    )
    dtype: Dtype = Field(
        "auto",
        description=(
            "`auto`: fp32 on a CPU (exact); on a GPU the checkpoint's `torch_dtype` (fp16 if none, as DJL LMI; "
            "fp16 for bf16 below compute capability 8.0). `bf16` on a CPU is the opt-in fast path where it computes "
            "bf16 in hardware (avx512_bf16 or AMX), not exact; elsewhere emulated and slower. Start-up logs the "
            f"choice (see [Faster on a CPU]({FAST_CPU}), [GPU dtype](gpu.md#dtype))"
        ),
    )
    device_map: str | None = Field(
        None,
        description=(
            "passed to `from_pretrained` (GPU only): `auto` spreads the layers of a model without a "
            "tensor-parallel plan over the GPUs"
        ),
    )
    tensor_parallel_degree: int | Literal["max"] = Field(
        1,
        description=(
            "int or `max`/-1 (every GPU; 1 on a CPU); > 1 shards the model over that many ranks (see [Tensor "
            "parallelism](models.md#tensor-parallelism))"
        ),
    )
    trust_remote_code: bool = Field(
        False,
        description=(
            "let transformers run Python code the model's repo ships (`trust_remote_code`); see "
            "[Security](security.md)"
        ),
    )
    revision: str | None = Field(
        None,
        description="the Hub branch, tag or commit to download",
        json_schema_extra={"doc_default": "`main`"},
    )
    # A Hub or S3 model with only *.bin / *.pt / *.pth / *.ckpt weights (unpickling runs code): refused unless set
    allow_pickled_weights: bool = Field(
        False,
        description=(
            "a Hub or S3 model whose only weights are pickled (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`) is downloaded "
            "and loaded instead of refused"
        ),
    )
    task: Task | None = Field(
        None,
        description=(
            "`text-generation`, `text2text-generation` (an encoder-decoder model; served by the same routes), "
            "`text-embedding`, `text-classification` (a `*ForSequenceClassification` model: rerankers, "
            "classifiers) or `tensor` (a model.py serving tensors, see Triton); inferred from the model's own"
            " files, see [Bring your own model](models.md#bring-your-own-model)"
        ),
        json_schema_extra={"doc_default": "inferred"},
    )
    entry_point: str | None = Field(
        None,
        description="handler file (path, or file in the model folder) or module",
        json_schema_extra={"doc_default": "`model.py` in the folder, else built-in"},
    )
    handler: str = Field("handle", description="handler function name")

    @field_validator("dtype", "task", mode="before")
    @classmethod
    def _model_choice(cls, value: Any, info: Any) -> Any:
        return choice(value, _CHOICES[info.field_name])

    @field_validator("trust_remote_code", "allow_pickled_weights", mode="before")
    @classmethod
    def _model_flag(cls, value: Any) -> bool:
        return parse_bool(value)

    @field_validator("tensor_parallel_degree", mode="before")
    @classmethod
    def _tp(cls, value: Any) -> int | str:
        text = str(value).strip().lower()
        if text in ("max", "-1"):
            return "max"
        try:
            degree = int(text)
        except ValueError:
            degree = 0
        if degree < 1:
            raise ValueError("must be an integer >= 1, 'max' or -1")
        return degree
