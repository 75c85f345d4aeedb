"""Built-in text-embedding handler: `{"inputs": str | [str | [token id]]}` -> a JSON list of vectors.

Mean pooling over the attention mask, then L2 normalisation: the same vectors as the
sentence-transformers pipeline of all-MiniLM-L6-v2, without needing that package. The inputs of a
dynamic batch (the requests that queued while the last forward ran, serving/service.py ENCODER_BATCHING)
share forwards: sorted by length, and cut where a forward would read more than MAX_BATCH_TOKENS padded
tokens (TEI's max_batch_tokens), so a long input does not pad a forward of short ones past the budget.

An input given as token ids is the model's whole input, used as given: nothing is decoded, and no
special tokens are added (the ids of `[CLS] hello world [SEP]` give the vector of "hello world").

The server calls `load(config, context)` with the validated ModelConfig (handler_protocol.py); DJL's
first `handle()` call with string properties still loads it too, validated back into a ModelConfig.
"""

from __future__ import annotations

import torch

from lmi_serve.config.sources import ModelConfig, options_not_taken
from lmi_serve.handler_api import Input, Output
from lmi_serve.handler_utils import parse_batch, read_payload
from lmi_serve.model.linear_kernels import use_linear_kernel
from lmi_serve.model.loader import load_encoder
from lmi_serve.serving.handler_protocol import HandlerContext, typed_from_properties

EmbeddingInput = str | list[int]  # a text, or the token ids the model reads
MAX_BATCH_TOKENS = 16384  # padded tokens (rows x longest row) in one forward: TEI's default max_batch_tokens


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in value)


def _parse(item: Input) -> list[EmbeddingInput]:
    payload = read_payload(item)
    if isinstance(payload, dict):
        unknown = sorted(set(payload) - {"inputs"})
        if unknown:
            raise ValueError(f"Unsupported field(s) {unknown}: the embedding schema has only 'inputs'")
        if "inputs" not in payload:
            raise ValueError("Missing required field 'inputs'")
        payload = payload["inputs"]
    inputs = [payload] if isinstance(payload, str) else payload
    if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) or _is_token_ids(x) for x in inputs):
        raise ValueError("'inputs' must be a string or a non-empty list of strings and non-empty token-id lists")
    return inputs


class EmbeddingService:
    def __init__(self, config: ModelConfig):
        # Options an embedding model does not take (config_models.NOT_TAKEN) are refused by name, not
        # ignored; the configuration already refuses them for a model declared text-embedding.
        for field, reason in options_not_taken(config, "text-embedding"):
            raise ValueError(f"option.{field}: {reason}")
        loaded = load_encoder(config.model_id or config.model_dir, dtype=config.dtype, device_map=config.device_map,
                              revision=config.revision, trust_remote_code=config.trust_remote_code)
        self.model, self.tokenizer, self.device = loaded.model, loaded.tokenizer, loaded.device
        # an encoder's batches are whole inputs, never one or two rows: no copy for the row kernel
        self.linear_kernel = use_linear_kernel(self.model, config.linear_kernel, self.device, row_kernel="off")
        self.max_length = min(self.tokenizer.model_max_length, 512)
        self.embed(["warm up"])

    @property
    def vocabulary_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    def checked_token_ids(self, ids: list[int]) -> list[int]:
        """`ids` if the model can read them as they are; a ValueError naming the problem if not."""
        bad = next((t for t in ids if not 0 <= t < self.vocabulary_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary of {self.vocabulary_size}")
        if len(ids) > self.max_length:
            raise ValueError(f"{len(ids)} token ids; this model reads at most {self.max_length}")
        return ids

    def input_ids(self, inputs: list[EmbeddingInput]) -> list[list[int]]:
        """Token ids per input: texts tokenized (special tokens added, truncated), ids as given."""
        texts = [x for x in inputs if isinstance(x, str)]
        encoded = iter(self.tokenizer(texts, truncation=True, max_length=self.max_length).input_ids if texts else ())
        return [next(encoded) if isinstance(x, str) else self.checked_token_ids(x) for x in inputs]

    def truncated_token_ids(self, texts: list[str], keep: int, side: str) -> list[list[int]]:
        """Each text's ids cut to `keep` tokens as `tokenizer(truncation=True, max_length=keep)`
        with that truncation side: the special tokens stay, the content loses its first tokens
        (`left`) or its last (`right`). Built here rather than by setting the shared tokenizer's
        truncation_side, which concurrent requests would race on."""
        rows = []
        for whole, content in zip(self.tokenizer(texts).input_ids,
                                  self.tokenizer(texts, add_special_tokens=False).input_ids):
            added = len(whole) - len(content)  # the special tokens, around the content
            before = next((i for i in range(added + 1) if whole[i:i + len(content)] == content), None)
            if before is None:
                raise ValueError("this tokenizer's special tokens do not surround the text; it cannot be cut")
            prefix, suffix = whole[:before], whole[before + len(content):]
            room = keep - added
            if room < 1:
                raise ValueError(f"{keep} tokens leave no room for text beside this model's {added} special tokens")
            if len(content) > room:
                content = content[:room] if side == "right" else content[len(content) - room:]
            rows.append(prefix + content + suffix)
        return rows

    def right_padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask) padded on the right, as the tokenizer pads: every row keeps
        the positions of an unpadded forward, so a batch gives each input its own vector."""
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(rows):
            input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, :len(ids)] = 1
        return input_ids.to(self.device), mask.to(self.device)

    def embed(self, inputs: list[EmbeddingInput]) -> list[list[float]]:
        """One vector per input, in order; forwards of rows of similar length within the token budget."""
        rows = self.input_ids(inputs)
        vectors: list[list[float] | None] = [None] * len(rows)
        for chunk in token_budget_chunks([len(r) for r in rows], MAX_BATCH_TOKENS):
            for i, vector in zip(chunk, self.forward([rows[i] for i in chunk])):
                vectors[i] = vector
        return vectors

    def forward(self, rows: list[list[int]]) -> list[list[float]]:
        input_ids, mask = self.right_padded(rows)
        with torch.inference_mode():
            hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled.float(), p=2, dim=1).tolist()

    def inference(self, inputs: Input) -> Output:
        output, inputs_by_item = parse_batch(inputs, self._parse_and_check)
        flat = [x for item_inputs in inputs_by_item.values() for x in item_inputs]
        vectors = iter(self.embed(flat)) if flat else iter(())
        for index, item_inputs in inputs_by_item.items():
            output.add([next(vectors) for _ in item_inputs], batch_index=index if inputs.is_batch() else None)
        return output

    def _parse_and_check(self, item: Input) -> list[EmbeddingInput]:
        """Parsed inputs; bad token ids fail their own request, not the dynamic batch they joined."""
        inputs = _parse(item)
        for x in inputs:
            if isinstance(x, list):
                self.checked_token_ids(x)
        return inputs


def token_budget_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Indexes of `lengths` sorted by length, cut so that rows x longest row stays within `budget`
    (a row longer than the budget goes alone)."""
    chunks: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if chunks and (len(chunks[-1]) + 1) * lengths[i] <= budget:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


_service: EmbeddingService | None = None


def load(config: ModelConfig, context: HandlerContext) -> None:
    """The server's typed first call (handler_protocol.TypedLoad): load the model once."""
    global _service
    _service = EmbeddingService(config)


def count_tokens(texts: list[str]) -> list[int]:
    """Each text's token count, special tokens included (what the model reads): usage and limits."""
    return [len(ids) for ids in _service.tokenizer(texts).input_ids]


def embedding_limits() -> tuple[int, int]:
    """(vector dimension, most tokens one input may have; longer ones would be truncated)."""
    return _service.model.config.hidden_size, _service.max_length


def vocabulary_size() -> int:
    """Token ids this model reads: 0 <= id < vocabulary_size(). Its presence tells /v1/embeddings
    that `inputs` may hold token-id lists, embedded as given."""
    return _service.vocabulary_size


def handle(inputs: Input) -> Output | None:
    """Requests; before `load`, DJL's first call (no content, the options as string properties)."""
    if _service is None:
        load(*typed_from_properties(inputs.get_properties(), "text-embedding"))
        return None
    if inputs.is_empty():
        return None
    return _service.inference(inputs)


def truncated_token_ids(texts: list[str], keep: int, side: str) -> list[list[int]]:
    """Each text's token ids cut to `keep` as the tokenizer truncates (see EmbeddingService):
    /v1/embeddings' `truncate_prompt_tokens` on texts."""
    return _service.truncated_token_ids(texts, keep, side)
