"""Asking a text-classification handler for logits: the request the vLLM scoring routes and Triton's
infer route put on its job queue (so they join its dynamic batches), and reading the answer.

The body is the handler's own pipeline shape with `function_to_apply: none` and `return_all_scores:
true` (handlers/classifier.py), so the answer is every label's logit per input, in label order; each
route then applies its API's activation (serving/classification.py).
"""

from __future__ import annotations

import json

from lmi_serve.handler_api import Input, PairList

Row = tuple[str, str | None]  # (text, text_pair or None)
_RAW = {"function_to_apply": "none", "return_all_scores": True}


def logits_request(rows: list[Row], request_id: str = "") -> Input:
    inputs = [text if pair is None else {"text": text, "text_pair": pair} for text, pair in rows]
    body = json.dumps({"inputs": inputs, "parameters": _RAW}).encode("utf-8")
    return Input({"Content-Type": "application/json", "requestId": request_id}, PairList([("data", body)]))


def read_logits(body: bytes, rows: int) -> list[list[float]]:
    """Every input's logits from the handler's answer; a ValueError if it is not that shape."""
    answer = json.loads(body)
    if not isinstance(answer, list) or len(answer) != rows:
        raise ValueError(f"the classifier answered {type(answer).__name__} for {rows} inputs")
    return [[float(entry["score"]) for entry in row] for row in answer]
