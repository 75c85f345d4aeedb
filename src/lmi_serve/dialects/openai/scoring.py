"""vLLM's scoring routes for text-classification models (cross-encoder rerankers, classifiers):

- POST /score, /v1/score: `text_1`, `text_2` (1:1, 1:N, N:N) -> `{"object": "list", "data": [{"index",
  "object": "score", "score"}], "usage"}`;
- POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape, as vLLM serves it): `query`,
  `documents` -> `{"id", "model", "usage": {"total_tokens"}, "results": [{"index", "document": {"text"},
  "relevance_score"}]}`, best first, `top_n` of them;
- POST /classify, /v1/classify: `input` -> `{"object": "list", "data": [{"index", "label", "probs",
  "num_classes"}], "usage"}`.

The model is chosen as on /v1 (`routes.choose_service`, task text-classification); errors are OpenAI's
envelope. The request goes to the handler's job queue (serving/classifier_call.py), so
concurrent requests share forwards; scores are the handler's logits under vLLM's activation
(serving/classification.py: /score and /rerank need a one-label cross-encoder).
"""

from __future__ import annotations

import json
import time
import uuid

from flask import Blueprint, Response, current_app, g, request

from lmi_serve import json_body
from lmi_serve.serving.classifier_call import Row, logits_request, read_logits
from lmi_serve.json_body import InvalidJson
from lmi_serve.dialects.openai.errors import render_kind
from lmi_serve.dialects.openai.routes import choose_service
from lmi_serve.dialects.openai.schema import parse
from lmi_serve.dialects.openai.scoring_schema import ClassifyRequest, RerankRequest, ScoreRequest
from lmi_serve.errors import GenerationFailed, InvalidRequest, ServingError
from lmi_serve.serving.classification import ClassifierHead, activate
from lmi_serve.serving.service import ModelService

blueprint = Blueprint("scoring", __name__)
# Outside /v1 these paths are vLLM's, so their errors (Flask's 404/405/413 too) are OpenAI's envelope.
ERROR_PREFIXES = ("/score", "/rerank", "/v2/rerank", "/classify")
TASK = "text-classification"


@blueprint.errorhandler(ServingError)
@blueprint.errorhandler(InvalidJson)
def _serving_error(exc: ServingError | InvalidJson) -> Response:
    return render_kind(exc)


def _classifier(name: str | None) -> tuple[ModelService, ClassifierHead]:
    registry = current_app.extensions["lmi_serve.serving.registry"]
    service = choose_service(registry.services, name, TASK, strict=current_app.config.get("STRICT_MODEL_NAMES", False))
    service.require_ready()
    caps = service.capabilities
    if caps.classifier_head is None or caps.count_tokens is None:
        raise InvalidRequest(f"The model `{service.name}`'s handler does not expose classifier_head and "
                             "count_tokens, which the scoring routes need", param="model")
    return service, caps.classifier_head()


def _cross_encoder(service: ModelService, head: ClassifierHead) -> None:
    if head.num_labels != 1:
        raise InvalidRequest(f"The model `{service.name}` is a classifier with {head.num_labels} labels; /score and "
                             "/rerank need a cross-encoder with one (use /classify)", param="model")


def _logits(service: ModelService, rows: list[Row]) -> list[list[float]]:
    """Every row's logits from the handler's job queue; its refusal is the client's 400, a failure a 500."""
    output = service.dispatcher.wait(service.submit(logits_request(rows, g.get("request_id", ""))))
    if output.code != 200:
        message = output.body().decode("utf-8", "replace")
        raise GenerationFailed(message) if output.code >= 500 else InvalidRequest(message)
    try:
        return read_logits(output.body(), len(rows))
    except (ValueError, KeyError, TypeError) as exc:
        raise GenerationFailed(f"model `{service.name}` answered an unexpected shape: {exc}") from None


def _usage(service: ModelService, rows: list[Row]) -> int:
    return sum(service.capabilities.count_tokens(rows))


def _json(body: dict) -> Response:
    return Response(json.dumps(body), mimetype="application/json")


def _scores(service: ModelService, head: ClassifierHead, rows: list[Row], activated: bool) -> list[float]:
    function = head.score_activation if activated else "none"
    return [activate(row, function)[0] for row in _logits(service, rows)]


@blueprint.post("/score")
@blueprint.post("/v1/score")
def score() -> Response:
    parsed: ScoreRequest = parse(ScoreRequest, json_body.loads(request.get_data()))
    pairs = parsed.pairs()
    service, head = _classifier(parsed.model)
    _cross_encoder(service, head)
    scores = _scores(service, head, pairs, parsed.activated)
    tokens = _usage(service, pairs)
    return _json({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                  "model": service.name,
                  "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                            "prompt_tokens_details": None}})


@blueprint.post("/rerank")
@blueprint.post("/v1/rerank")
@blueprint.post("/v2/rerank")
def rerank() -> Response:
    parsed: RerankRequest = parse(RerankRequest, json_body.loads(request.get_data()))
    service, head = _classifier(parsed.model)
    _cross_encoder(service, head)
    documents = parsed.texts
    pairs = [(parsed.query, d) for d in documents]
    scores = _scores(service, head, pairs, parsed.activated)
    # best first; equal scores keep the documents' order (sorted is stable)
    ranked = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)[:parsed.top_n or None]
    results = [{"index": i, **({"document": {"text": documents[i]}} if parsed.return_documents else {}),
                "relevance_score": scores[i]} for i in ranked]
    return _json({"id": f"rerank-{uuid.uuid4().hex}", "model": service.name,
                  "usage": {"total_tokens": _usage(service, pairs)}, "results": results})


@blueprint.post("/classify")
@blueprint.post("/v1/classify")
def classify() -> Response:
    parsed: ClassifyRequest = parse(ClassifyRequest, json_body.loads(request.get_data()))
    service, head = _classifier(parsed.model)
    rows = [(text, None) for text in parsed.texts]
    function = head.classify_activation if parsed.activated else "none"
    data = []
    for i, logits in enumerate(_logits(service, rows)):
        probs = activate(logits, function)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": head.labels[best], "probs": probs, "num_classes": len(probs)})
    tokens = _usage(service, rows)
    return _json({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                  "model": service.name, "data": data,
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                            "prompt_tokens_details": None}})
