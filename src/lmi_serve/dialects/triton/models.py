"""Which served model is which Triton model: tensor contracts, metadata, config, input validation.

Three kinds of model speak tensors:
- `llm`: a text-generation model on the rolling batch (its contract is in llm.py);
- `embedding`: a text-embedding model, `text_input` BYTES [-1] -> `embedding` FP32 [-1, dim];
- `classifier`: a text-classification model (a cross-encoder reranker, a classifier), `text_input`
  BYTES [-1] and optionally `text_pair` BYTES [-1] (a reranker's documents beside its queries) ->
  `logits` FP32 [-1, labels] and `scores` FP32 [-1, labels] (vLLM's score activation:
  serving/classification.py);
- `tensor`: a custom model.py that declares INPUT_TENSORS / OUTPUT_TENSORS (tensor_model.py).
Every model has one version, "1", and `max_batch_size` 0: shapes are exactly as declared.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmi_serve.dialects.triton.llm import LLM_INPUTS, LLM_OUTPUTS
from lmi_serve.dialects.triton.protocol import BadRequest, Unavailable, UnknownTarget
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService, ModelStatus
from lmi_serve.tensor_model import TensorSpec
from lmi_serve.tensors import WireTensor

MODEL_VERSION = "1"
CONFIG_TYPES = {"BYTES": "TYPE_STRING"}  # every other datatype is TYPE_<datatype>


@dataclass(frozen=True)
class ModelContract:
    kind: str  # "llm", "embedding", "classifier" or "tensor"
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # The LLM's [1] inputs also take [1, 1] (TensorRT-LLM clients) or any shape holding one element.
    lenient_single_elements: bool = False

    def input(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.inputs if spec.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.outputs if spec.name == name), None)


def contract_for(service: ModelService) -> ModelContract:
    """The contract of a READY model; a model with none answers 400 on inference routes."""
    if service.engine is not None:
        return ModelContract("llm", LLM_INPUTS, LLM_OUTPUTS, lenient_single_elements=True)
    caps = service.capabilities
    if service.task == "text-embedding":
        # the handler's own width (after the checkpoint's pooling modes and Dense layers); -1 if it does not say
        dim = caps.embedding_limits()[0] if caps is not None and caps.embedding_limits is not None else -1
        return ModelContract("embedding", (TensorSpec("text_input", "BYTES", (-1,)),),
                             (TensorSpec("embedding", "FP32", (-1, dim)),))
    if service.task == "text-classification" and caps is not None and caps.classifier_head is not None:
        labels = caps.classifier_head().num_labels
        return ModelContract("classifier", (TensorSpec("text_input", "BYTES", (-1,)),
                                            TensorSpec("text_pair", "BYTES", (-1,), optional=True)),
                             (TensorSpec("logits", "FP32", (-1, labels)), TensorSpec("scores", "FP32", (-1, labels))))
    if caps is not None and caps.serves_tensors:
        return ModelContract("tensor", caps.input_tensors, caps.output_tensors)
    raise BadRequest(f"model '{service.name}' does not speak tensors: a text-generation model needs the "
                     "rolling batch, and a custom model.py must declare INPUT_TENSORS and OUTPUT_TENSORS")


def find_model(registry: ModelRegistry, name: str, version: str | None) -> ModelService:
    service = registry.services.get(name)
    if service is None:
        raise UnknownTarget(f"Request for unknown model: '{name}' is not found")
    if version not in (None, "", MODEL_VERSION):
        raise UnknownTarget(f"Request for unknown model: '{name}' version {version} is not found")
    service.requested()
    return service


def ready_model(registry: ModelRegistry, name: str, version: str | None) -> tuple[ModelService, ModelContract]:
    service = find_model(registry, name, version)
    if service.current_status() is not ModelStatus.READY:
        raise Unavailable(f"Request for unknown model: '{name}' version {MODEL_VERSION} is not at ready state")
    return service, contract_for(service)


def model_metadata(service: ModelService, contract: ModelContract) -> dict:
    def entries(specs):
        return [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in specs]

    return {"name": service.name, "versions": [MODEL_VERSION], "platform": "python",
            "inputs": entries(contract.inputs), "outputs": entries(contract.outputs)}


def model_config(service: ModelService, contract: ModelContract) -> dict:
    def entries(specs, with_optional):
        return [{"name": s.name, "data_type": CONFIG_TYPES.get(s.datatype, f"TYPE_{s.datatype}"),
                 "dims": list(s.shape), **({"optional": s.optional} if with_optional else {})} for s in specs]

    return {"name": service.name, "platform": "", "backend": "python", "max_batch_size": 0,
            "input": entries(contract.inputs, True), "output": entries(contract.outputs, False),
            "version_policy": {"latest": {"num_versions": 1}},
            "model_transaction_policy": {"decoupled": False},
            "parameters": {"task": {"string_value": service.task}}}


def _names(names) -> str:
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def _shape_text(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _shape_fits(spec: TensorSpec, shape: tuple[int, ...], lenient: bool) -> bool:
    if lenient and spec.shape == (1,) and len(shape) >= 1 and all(d == 1 for d in shape):
        return True
    return len(shape) == len(spec.shape) and all(want in (-1, got) for want, got in zip(spec.shape, shape))


def validate_inputs(model: str, contract: ModelContract, tensors: list[WireTensor]) -> dict[str, WireTensor]:
    """Triton's checks of a request against the model, in its order and words."""
    for tensor in tensors:
        if contract.input(tensor.name) is None:
            raise BadRequest(f"unexpected inference input '{tensor.name}' for model '{model}'")
    given = [t.name for t in tensors]
    required = [s.name for s in contract.inputs if not s.optional]
    missing = [name for name in required if name not in given]
    if missing:
        expected = (f"expected {len(required)} inputs" if len(required) == len(contract.inputs) else
                    f"expected number of inputs between {len(required)} and {len(contract.inputs)}")
        raise BadRequest(f"{expected} but got {len(given)} inputs for model '{model}'. Got input(s) "
                         f"{_names(given)}, but missing required input(s) {_names(missing)}. "
                         "Please provide all required input(s).")
    for tensor in tensors:
        spec = contract.input(tensor.name)
        if tensor.datatype != spec.datatype:
            raise BadRequest(f"inference input '{tensor.name}' data-type is '{tensor.datatype}', but model "
                             f"'{model}' expects '{spec.datatype}'")
        if not _shape_fits(spec, tensor.shape, contract.lenient_single_elements):
            raise BadRequest(f"unexpected shape for input '{tensor.name}' for model '{model}'. Expected "
                             f"{_shape_text(spec.shape)}, got {_shape_text(tensor.shape)}")
    return {tensor.name: tensor for tensor in tensors}


def repository_index(registry: ModelRegistry, ready_only: bool) -> list[dict]:
    states = {ModelStatus.READY: "READY", ModelStatus.LOADING: "LOADING", ModelStatus.FAILED: "UNAVAILABLE"}
    index = []
    for service in registry.services.values():
        status = service.current_status()
        if ready_only and status is not ModelStatus.READY:
            continue
        entry = {"name": service.name, "version": MODEL_VERSION, "state": states[status]}
        if status is ModelStatus.FAILED:
            entry["reason"] = service.error or "failed to load"
        index.append(entry)
    return index
