"""Built-in text-embedding handler: `{"inputs": str | [str | [token id]]}` -> a JSON list of vectors.

Each checkpoint's vectors are the ones its sentence-transformers files declare (model/sentence_config.py:
pooling mode, Dense layers, normalisation, `max_seq_length`, lower-casing, named prompts), computed by
model/pooling.py; a folder without those files gets mean pooling and L2 normalisation. Optional fields:
`prompt_name` (one of the model's prompts; unset: its default prompt) or `prompt` (a text put before each
text input, as sentence-transformers' `encode(prompt=...)`; token-id inputs are whole inputs and get none), `normalize` (true or false: overrides
the checkpoint's Normalize module) and `dimensions` (the first N components, renormalised where the
vectors are normalised: Matryoshka truncation). The inputs of a
dynamic batch (the requests that queued while the last forward ran, serving/service.py ENCODER_BATCHING)
share forwards: sorted by length, and cut where a forward would read more than MAX_BATCH_TOKENS padded
tokens (TEI's max_batch_tokens), so a long input does not pad a forward of short ones past the budget.

An input given as token ids is the model's whole input, used as given: nothing is decoded, and no
special tokens are added (the ids of `[CLS] hello world [SEP]` give the vector of "hello world").

The server calls `load(config, context)` with the validated ModelConfig (handler_protocol.py); DJL's
first `handle()` call with string properties still loads it too, validated back into a ModelConfig.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from lmi_serve import echo
from lmi_serve.config.sources import ModelConfig, options_not_taken
from lmi_serve.handler_api import Input, Output
from lmi_serve.handler_utils import parse_batch, read_payload
from lmi_serve.kernels.host import probe
from lmi_serve.kernels.plan import KernelPlan, plan_kernels
from lmi_serve.model.loader import load_encoder
from lmi_serve.model.pooling import SentenceHead, finish
from lmi_serve.model.sentence_config import SentenceConfig, read_sentence_config
from lmi_serve.serving.handler_protocol import HandlerContext, typed_from_properties

log = logging.getLogger(__name__)
EmbeddingInput = str | list[int]  # a text, or the token ids the model reads
Row = tuple[list[int], int]  # (token ids, leading prompt tokens that pooling leaves out)
MAX_BATCH_TOKENS = 16384  # padded tokens (rows x longest row) in one forward: TEI's default max_batch_tokens
_FIELDS = {"inputs", "prompt_name", "prompt", "normalize", "dimensions"}


class Request(NamedTuple):
    """One request's inputs and how its vectors are prepared and finished. A NamedTuple: handler files
    load outside sys.modules, which dataclasses need."""

    inputs: list[EmbeddingInput]
    prompt_name: str | None = None
    prompt: str | None = None  # a literal prompt; None: `prompt_name`'s, or the model's default
    normalize: bool | None = None  # None: as the checkpoint declares
    dimensions: int | None = None


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in value)


def _parse(item: Input) -> Request:
    payload = read_payload(item)
    fields = {}
    if isinstance(payload, dict):
        unknown = echo.unknown(payload, _FIELDS)
        if unknown:
            raise ValueError(f"Unsupported field(s) {echo.names(unknown)}: the embedding schema has {sorted(_FIELDS)}")
        if "inputs" not in payload:
            raise ValueError("Missing required field 'inputs'")
        fields = {k: v for k, v in payload.items() if k != "inputs" and v is not None}
        payload = payload["inputs"]
    inputs = [payload] if isinstance(payload, str) else payload
    if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) or _is_token_ids(x) for x in inputs):
        raise ValueError("'inputs' must be a string or a non-empty list of strings and non-empty token-id lists")
    for name, kind in (("prompt_name", str), ("prompt", str), ("normalize", bool)):
        if name in fields and not isinstance(fields[name], kind):
            raise ValueError(f"'{name}' must be a {kind.__name__}")
    dimensions = fields.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1):
        raise ValueError("'dimensions' must be a positive integer")
    if "prompt" in fields and "prompt_name" in fields:
        raise ValueError("'prompt' and 'prompt_name' both name a prompt: send one")
    return Request(inputs, **fields)


class EmbeddingService:
    def __init__(self, config: ModelConfig):
        # Options an embedding model does not take (config_models.NOT_TAKEN) are refused by name, not
        # ignored; the configuration already refuses them for a model declared text-embedding.
        for field, reason in options_not_taken(config, "text-embedding"):
            raise ValueError(f"option.{field}: {reason}")
        loaded = load_encoder(config.model_id or config.model_dir, dtype=config.dtype, device_map=config.device_map,
                              revision=config.revision, trust_remote_code=config.trust_remote_code)
        self.model, self.tokenizer, self.device = loaded.model, loaded.tokenizer, loaded.device
        self.sentence: SentenceConfig = read_sentence_config(loaded.source)
        self.head = SentenceHead(self.sentence, self.device)
        if self.sentence.do_lower_case:
            lowercase_tokenizer(self.tokenizer)
        # an encoder's batches are whole inputs, never one or two rows: no copy for the row kernel (kernels/plan.py)
        self.kernels = plan_kernels(self.model, config, probe(), device=self.device, generates=False)
        log.info("%s", self.kernels.summary())
        self.max_length = self.sentence.max_seq_length or min(
            self.tokenizer.model_max_length, getattr(self.model.config, "max_position_embeddings", 512) or 512)
        self.dimension = self.sentence.dimension(self.model.config.hidden_size)
        log.info("Embedding pipeline of %s: %s; at most %d tokens an input, %d dimensions", loaded.source,
                 self.sentence.describe(), self.max_length, self.dimension)
        self._prompt_lengths: dict[str, int] = {}
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

    def prompt_text(self, request: Request) -> str:
        """The text put before each of the request's texts: its own, its named one, or the model's default."""
        return request.prompt if request.prompt is not None else self.sentence.prompt(request.prompt_name)

    def prompt_length(self, prompt: str) -> int:
        """Tokens of `prompt` at the start of a prompted input that pooling leaves out (include_prompt:
        false): its tokens alone, less a trailing special token, as sentence-transformers counts them."""
        if not prompt or self.sentence.include_prompt:
            return 0
        if prompt not in self._prompt_lengths:
            ids = self.tokenizer(prompt).input_ids
            special = set(self.tokenizer.all_special_ids)
            self._prompt_lengths[prompt] = len(ids) - (1 if ids and ids[-1] in special else 0)
        return self._prompt_lengths[prompt]

    def rows(self, request: Request) -> list[Row]:
        """(token ids, prompt tokens not pooled) per input: texts prompted, tokenized (special tokens
        added, truncated to the model's limit); ids as given."""
        prompt = self.prompt_text(request)
        texts = [prompt + x for x in request.inputs if isinstance(x, str)]
        encoded = iter(self.tokenizer(texts, truncation=True, max_length=self.max_length).input_ids if texts else ())
        skip = self.prompt_length(prompt)
        return [(next(encoded), skip) if isinstance(x, str) else (self.checked_token_ids(x), 0)
                for x in request.inputs]

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
        """(input ids, attention mask) padded on the right: every row keeps the positions of an
        unpadded forward, and a causal model's states for its tokens, so a batch gives each input its
        own vector (model/pooling.py picks each row's own first and last tokens)."""
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(rows):
            input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, :len(ids)] = 1
        return input_ids.to(self.device), mask.to(self.device)

    def embed(self, inputs: list[EmbeddingInput], **fields) -> list[list[float]]:
        """One request's vectors, in order (`fields`: Request's other fields)."""
        return self.embed_requests([Request(list(inputs), **fields)])[0]

    def embed_requests(self, requests: list[Request]) -> list[list[list[float]]]:
        """Each request's vectors; the rows of all of them share forwards of rows of similar length
        within the token budget, and each request's vectors are finished as it asks."""
        owners, rows = [], []
        for r, request in enumerate(requests):
            for row in self.rows(request):
                owners.append(r)
                rows.append(row)
        vectors: list[torch.Tensor | None] = [None] * len(rows)
        for chunk in token_budget_chunks([len(ids) for ids, _ in rows], MAX_BATCH_TOKENS):
            for i, vector in zip(chunk, self.forward([rows[i] for i in chunk])):
                vectors[i] = vector
        out: list[list[list[float]]] = [[] for _ in requests]
        for owner, vector in zip(owners, vectors):
            request = requests[owner]
            normalize = self.sentence.normalize if request.normalize is None else request.normalize
            out[owner].append(finish(vector, normalize, request.dimensions).tolist())
        return out

    def forward(self, rows: list[Row]) -> torch.Tensor:
        """The head's vectors (before `finish`) of `rows`, one padded forward."""
        input_ids, mask = self.right_padded([ids for ids, _ in rows])
        skip = torch.tensor([n for _, n in rows], device=mask.device) if any(n for _, n in rows) else None
        with torch.inference_mode():
            hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            return self.head(hidden, mask, skip)

    def inference(self, inputs: Input) -> Output:
        output, requests = parse_batch(inputs, self._parse_and_check)
        vectors = iter(self.embed_requests(list(requests.values()))) if requests else iter(())
        for index in requests:
            output.add(next(vectors), batch_index=index if inputs.is_batch() else None)
        return output

    def _parse_and_check(self, item: Input) -> Request:
        """A parsed request; bad token ids, prompt names or dimensions fail their own request, not the
        dynamic batch it joined."""
        request = _parse(item)
        for x in request.inputs:
            if isinstance(x, list):
                self.checked_token_ids(x)
        self.prompt_text(request)
        if request.dimensions is not None and request.dimensions > self.dimension:
            raise ValueError(f"dimensions {request.dimensions} exceeds this model's {self.dimension}")
        return request


def lowercase_tokenizer(tokenizer) -> None:
    """Lower-case every text before tokenizing (sentence_bert_config's `do_lower_case`), as
    sentence-transformers does: a Lowercase normalizer first in the fast tokenizer's pipeline."""
    from tokenizers.normalizers import Lowercase, Sequence

    backend = tokenizer.backend_tokenizer
    current = backend.normalizer
    if current is not None and "Lowercase" in repr(current):
        return
    backend.normalizer = Sequence([Lowercase()] + ([current] if current is not None else []))


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


def get_kernel_plan() -> KernelPlan | None:
    """What runs the model's forward on this host (kernels/plan.py), for GET /models/<m>."""
    return _service.kernels if _service else None


def count_tokens(texts: list[str]) -> list[int]:
    """Each text's token count, special tokens included (what the model reads): usage and limits."""
    return [len(ids) for ids in _service.tokenizer(texts).input_ids]


def embedding_limits() -> tuple[int, int]:
    """(vector dimension, most tokens one input may have; longer ones would be truncated)."""
    return _service.dimension, _service.max_length


def embedding_prompt(name: str | None) -> tuple[str, bool]:
    """(the text of prompt `name`, or of the default prompt for None; whether pooling reads the prompt's
    tokens). A ValueError for a name the model does not declare. Its presence tells /v1/embeddings that
    this handler takes `prompt`, `normalize` and `dimensions` in its requests."""
    return _service.sentence.prompt(name), _service.sentence.include_prompt


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
