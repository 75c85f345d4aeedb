"""Built-in text-classification handler: `*ForSequenceClassification` models (rerankers, classifiers).

Request (transformers' text-classification pipeline, as DJL's pipeline handler takes it):
`{"inputs": X, "parameters": {...}}` or X alone, where X is a text, a pair `{"text": q, "text_pair": d}`
(a cross-encoder's query and document), or a list of those. Parameters are the pipeline's: `top_k` (an
int, or null for every label), `function_to_apply` (`sigmoid`, `softmax`, `none`), and the legacy
`return_all_scores`. The answer is the pipeline's: `[{"label", "score"}]` for one text, one entry per
input for a list; with `top_k` each input gets its labels sorted by score; with `return_all_scores`
every label in label order.

The vLLM routes (/score, /rerank, /classify) and Triton's infer route ask for the raw logits
(`function_to_apply: none`, `return_all_scores: true`) and apply their own API's activation
(serving/classification.py), so all of them read the same forward.

Inputs are truncated to the model's limit (pairs longest-first), as sentence-transformers' CrossEncoder
does. The inputs of a dynamic batch (serving/service.py ENCODER_BATCHING) share forwards, sorted by
length and cut at MAX_BATCH_TOKENS padded tokens, as the embedding handler does.
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

import torch

from lmi_serve import echo
from lmi_serve.config.sources import ModelConfig, options_not_taken
from lmi_serve.handler_api import Input, Output
from lmi_serve.handler_utils import parse_batch, read_payload
from lmi_serve.kernels.host import probe
from lmi_serve.kernels.plan import KernelPlan, plan_kernels
from lmi_serve.model.loader import load_encoder
from lmi_serve.serving.classification import ACTIVATIONS, ClassifierHead, activate, head_from_config
from lmi_serve.serving.handler_protocol import HandlerContext, typed_from_properties
from lmi_serve.serving.handlers.embeddings import token_budget_chunks  # the one token-budget rule

log = logging.getLogger(__name__)

TASK = "text-classification"
MAX_BATCH_TOKENS = 16384  # padded tokens in one forward, as embeddings.py (TEI's max_batch_tokens)
_PARAMETERS = {"top_k", "function_to_apply", "return_all_scores"}
Row = tuple[str, str | None]  # (text, text_pair or None)


class Request(NamedTuple):
    """One request of a batch: its rows, and how its answer is shaped (the pipeline's rules). A
    NamedTuple, not a dataclass: handler files load outside sys.modules, which dataclasses need."""

    rows: list[Row]
    single: bool  # X was one text or pair, not a list
    single_text: bool  # X was one text (the pipeline wraps its legacy answer in a list)
    function: str | None  # None: the head's pipeline default
    top_k: int | None
    legacy: bool  # top_k not given: the top label alone, or every label in label order


def _row(value, where: str) -> Row:
    if isinstance(value, str):
        return value, None
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        unknown = echo.unknown(value, {"text", "text_pair"})
        pair = value.get("text_pair")
        if unknown or not (pair is None or isinstance(pair, str)):
            raise ValueError(f"{where}: a pair is {{\"text\": str, \"text_pair\": str}}; got keys {echo.names(value)}")
        return value["text"], pair
    raise ValueError(f"{where} must be a text or {{\"text\": ..., \"text_pair\": ...}}, not {type(value).__name__}")


def parse_request(payload) -> Request:
    """The pipeline's request rules; a ValueError names what is wrong (a 424 for this request alone)."""
    parameters = {}
    if isinstance(payload, dict) and "inputs" in payload:
        unknown = echo.unknown(payload, {"inputs", "parameters"})
        if unknown:
            raise ValueError(f"Unsupported field(s) {echo.names(unknown)}: a text-classification request has 'inputs' and "
                             "'parameters'")
        parameters = payload.get("parameters") or {}
        payload = payload["inputs"]
    if not isinstance(parameters, dict):
        raise ValueError("'parameters' must be an object")
    unknown = echo.unknown(parameters, _PARAMETERS)
    if unknown:
        raise ValueError(f"Unsupported parameter(s) {echo.names(unknown)}: this model is a {TASK} model, which takes "
                         f"{sorted(_PARAMETERS)} (text-generation parameters do not apply)")
    if isinstance(payload, list):
        if not payload:
            raise ValueError("'inputs' must not be an empty list")
        rows = [_row(x, f"inputs[{i}]") for i, x in enumerate(payload)]
    else:
        rows = [_row(payload, "inputs")]
    function = parameters.get("function_to_apply")
    if function is not None and function not in ACTIVATIONS:
        raise ValueError(f"function_to_apply must be one of {list(ACTIVATIONS)}, not {function!r}")
    legacy = "top_k" not in parameters
    top_k = parameters.get("top_k") if not legacy else 1
    if not legacy and top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or null, not {top_k!r}")
    if legacy and "return_all_scores" in parameters:
        if not isinstance(parameters["return_all_scores"], bool):
            raise ValueError("return_all_scores must be true or false")
        top_k = None if parameters["return_all_scores"] else 1
    return Request(rows, single=not isinstance(payload, list), single_text=isinstance(payload, str),
                   function=function, top_k=top_k, legacy=legacy)


def shape_answer(request: Request, logits: list[list[float]], head: ClassifierHead):
    """The pipeline's answer to `request` from its rows' logits."""
    results = []
    for row in logits:
        scores = activate(row, request.function or head.pipeline_activation)
        entries = [{"label": label, "score": score} for label, score in zip(head.labels, scores)]
        if request.legacy and request.top_k == 1:
            results.append(max(entries, key=lambda e: e["score"]))
            continue
        if not request.legacy:
            entries.sort(key=lambda e: e["score"], reverse=True)
            entries = entries if request.top_k is None else entries[:request.top_k]
        results.append(entries)
    if not request.single:
        return results
    return [results[0]] if request.single_text and request.legacy else results[0]


class ClassifierService:
    def __init__(self, config: ModelConfig):
        for field, reason in options_not_taken(config, TASK):
            raise ValueError(f"option.{field}: {reason}")
        loaded = load_encoder(config.model_id or config.model_dir, dtype=config.dtype, device_map=config.device_map,
                              revision=config.revision, trust_remote_code=config.trust_remote_code,
                              head="AutoModelForSequenceClassification")
        self.model, self.tokenizer, self.device = loaded.model, loaded.tokenizer, loaded.device
        # an encoder's batches are whole inputs, never one or two rows: no copy for the row kernel (kernels/plan.py)
        self.kernels = plan_kernels(self.model, config, probe(), device=self.device, generates=False)
        log.info("%s", self.kernels.summary())
        self.max_length = min(self.tokenizer.model_max_length, 512)
        self.head = head_from_config(self.model.config.to_dict())
        # count_tokens runs on request threads beside the batch's forward: a fast tokenizer called with
        # truncation settings from two threads at once can fail ("Already borrowed")
        self.tokenizer_lock = threading.Lock()
        self.logits([("warm up", None)])

    def encode(self, rows: list[Row]) -> list[dict[str, list[int]]]:
        """Each row's model inputs (ids, and token types where the model has them), truncated."""
        out: list[dict[str, list[int]] | None] = [None] * len(rows)
        singles = [i for i, (_, pair) in enumerate(rows) if pair is None]
        pairs = [i for i, (_, pair) in enumerate(rows) if pair is not None]
        for indexes, args in ((singles, ([rows[i][0] for i in singles],)),
                              (pairs, ([rows[i][0] for i in pairs], [rows[i][1] for i in pairs]))):
            if not indexes:
                continue
            with self.tokenizer_lock:
                encoded = self.tokenizer(*args, truncation=True, max_length=self.max_length)
            types = encoded.get("token_type_ids")
            for j, i in enumerate(indexes):
                out[i] = {"input_ids": encoded["input_ids"][j],
                          **({"token_type_ids": types[j]} if types is not None else {})}
        return out

    def count_tokens(self, rows: list[Row]) -> list[int]:
        return [len(e["input_ids"]) for e in self.encode(rows)]

    def logits(self, rows: list[Row]) -> list[list[float]]:
        """One row of logits per input, in order; forwards of similar lengths within the token budget."""
        encoded = self.encode(rows)
        result: list[list[float] | None] = [None] * len(rows)
        for chunk in token_budget_chunks([len(e["input_ids"]) for e in encoded], MAX_BATCH_TOKENS):
            for i, row in zip(chunk, self.forward([encoded[i] for i in chunk])):
                result[i] = row
        return result

    def forward(self, rows: list[dict[str, list[int]]]) -> list[list[float]]:
        # right padding, as the tokenizer pads: each row keeps the positions of its unpadded forward
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        types = torch.zeros_like(ids) if "token_type_ids" in rows[0] else None
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            mask[i, :n] = 1
            if types is not None:
                types[i, :n] = torch.tensor(r["token_type_ids"])
        inputs = {"input_ids": ids, "attention_mask": mask, **({"token_type_ids": types} if types is not None else {})}
        with torch.inference_mode():
            logits = self.model(**{k: v.to(self.device) for k, v in inputs.items()}).logits
        return logits.float().cpu().tolist()

    def inference(self, inputs: Input) -> Output:
        output, requests = parse_batch(inputs, lambda item: parse_request(read_payload(item)))
        flat = [row for request in requests.values() for row in request.rows]
        logits = iter(self.logits(flat)) if flat else iter(())
        for index, request in requests.items():
            rows = [next(logits) for _ in request.rows]
            output.add(shape_answer(request, rows, self.head), batch_index=index if inputs.is_batch() else None)
        return output


_service: ClassifierService | None = None


def load(config: ModelConfig, context: HandlerContext) -> None:
    """The server's typed first call (handler_protocol.TypedLoad): load the model once."""
    global _service
    _service = ClassifierService(config)


def get_kernel_plan() -> KernelPlan | None:
    """What runs the model's forward on this host (kernels/plan.py), for GET /models/<m>."""
    return _service.kernels if _service else None


def count_tokens(rows: list[Row]) -> list[int]:
    """Tokens the model reads per (text, text_pair or None), special tokens included, after truncation: usage."""
    return _service.count_tokens(rows)


def classifier_head() -> ClassifierHead:
    """The labels and default activations (serving/classification.py): the vLLM and Triton routes' scores."""
    return _service.head


def handle(inputs: Input) -> Output | None:
    """Requests; before `load`, DJL's first call (no content, the options as string properties)."""
    if _service is None:
        load(*typed_from_properties(inputs.get_properties(), TASK))
        return None
    if inputs.is_empty():
        return None
    return _service.inference(inputs)
