"""Built-in text-embedding handler: `{"inputs": str | [str]}` -> a JSON list of vectors.

Mean pooling over the attention mask, then L2 normalisation: the same vectors as the
sentence-transformers pipeline of all-MiniLM-L6-v2, without needing that package. All texts of a
dynamic batch go through one padded forward.
"""

from __future__ import annotations

import torch

from lmi_serve.handler_api import Input, Output
from lmi_serve.handler_utils import parse_batch, read_payload
from lmi_serve.model.loader import load_encoder


def _parse(item: Input) -> list[str]:
    payload = read_payload(item)
    if isinstance(payload, dict):
        unknown = sorted(set(payload) - {"inputs"})
        if unknown:
            raise ValueError(f"Unsupported field(s) {unknown}: the embedding schema has only 'inputs'")
        if "inputs" not in payload:
            raise ValueError("Missing required field 'inputs'")
        payload = payload["inputs"]
    texts = [payload] if isinstance(payload, str) else payload
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("'inputs' must be a string or a non-empty list of strings")
    return texts


class EmbeddingService:
    def __init__(self, props: dict[str, str]):
        loaded = load_encoder(props.get("model_id") or props["model_dir"], dtype=props.get("dtype", "auto"),
                              device_map=props.get("device_map") or None, revision=props.get("revision") or None,
                              trust_remote_code=str(props.get("trust_remote_code", "false")).lower() == "true")
        self.model, self.tokenizer, self.device = loaded.model, loaded.tokenizer, loaded.device
        self.max_length = min(self.tokenizer.model_max_length, 512)
        self.embed(["warm up"])

    def embed(self, texts: list[str]) -> list[list[float]]:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt").to(self.device)
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled.float(), p=2, dim=1).tolist()

    def inference(self, inputs: Input) -> Output:
        output, texts_by_item = parse_batch(inputs, _parse)
        flat = [text for texts in texts_by_item.values() for text in texts]
        vectors = iter(self.embed(flat)) if flat else iter(())
        for index, texts in texts_by_item.items():
            output.add([next(vectors) for _ in texts], batch_index=index if inputs.is_batch() else None)
        return output


_service: EmbeddingService | None = None


def count_tokens(texts: list[str]) -> list[int]:
    """Each text's token count, special tokens included (what the model reads): usage and limits."""
    return [len(ids) for ids in _service.tokenizer(texts).input_ids]


def embedding_limits() -> tuple[int, int]:
    """(vector dimension, most tokens one input may have; longer ones would be truncated)."""
    return _service.model.config.hidden_size, _service.max_length


def decode_tokens(token_lists: list[list[int]]) -> list[str]:
    """Texts for inputs given as token ids of this model's tokenizer."""
    return [_service.tokenizer.decode(ids, skip_special_tokens=True) for ids in token_lists]


def handle(inputs: Input) -> Output | None:
    """DJL contract: the first call (no content) carries the model options and loads the model."""
    global _service
    if _service is None:
        _service = EmbeddingService(inputs.get_properties())
        return None
    if inputs.is_empty():
        return None
    return _service.inference(inputs)
