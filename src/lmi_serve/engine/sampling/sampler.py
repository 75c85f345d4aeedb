"""Per-row token choice for a batch whose rows each carry their own SamplingParams.

Order of operations for one step (`HeterogeneousSampler.__call__`):
1. log-softmax of the raw logits: the logprob reported for a token (chosen or top-n) is the model's own.
2. penalties, only if some row uses them: repetition (prompt + generated tokens, HF semantics),
   then presence and frequency (generated tokens, OpenAI semantics); then logit biases and the
   step's watermark bias (watermark.py); then the token mask (`allowed`: grammars, allowed ids,
   bans; see token_masks.py), so greedy and sampled rows alike obey it.
3. greedy rows: argmax of the penalised scores; all greedy rows share one argmax.
4. sampled rows: temperature, then min-p and typical-p, each only on the rows that use them and
   over the whole vocabulary (typical-p ranks every token by its distance to the entropy of the
   whole distribution, so its rows pay a full sort).
5. each sampled row's distribution, without sorting the vocabulary:
   - no top-k and no top-p: the softmax over the whole vocabulary;
   - otherwise a `torch.topk` candidate set, best first (the largest top_k of the rows + 1, or
     CANDIDATES for a row without top-k): ranks from top_k on are dropped, probabilities are the
     softmax over the top k (without top-k: over the whole vocabulary), and a token is dropped once
     the mass before it reaches top_p. A row whose kept tokens do not end inside its candidates
     tries WIDEN times more where the candidates show that might do, else sorts its whole row; so
     does a row whose kept tokens end between two equal scores (which of them the sort keeps first
     is the sort's own order).
   A row's kept tokens and probabilities do not depend on how many candidates it got, so not on the
   other rows. They are the full sort's: bit for bit with top-k; without, up to the rounding of the
   whole-vocabulary normaliser (summed in token-id order, not in sorted order), which moves each
   CDF boundary by ~1e-7 and so changes ~0.5% of the draws of a temperature-only row over 49k tokens.
6. one uniform draw per row from that row's own `torch.Generator`, inverted through the CDF of its
   kept tokens in token-id order. A seeded request gets the same sample whatever else is in the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from lmi_serve.engine.types import SamplingParams

# The first candidate set of a top-p row without top-k. With SmolLM2 at temperature 1, a 0.9 nucleus
# fits in 256 tokens at ~96% of steps and in 1024 at all but ~0.3%; topk(256) costs ~2% of a sort.
CANDIDATES = 256
# A row whose kept tokens do not fit tries again with 8x the candidates, or sorts its row once that
# would be over an eighth of the vocabulary (of 49152: topk(2048) costs ~12% of a sort, topk(16384) ~40%).
WIDEN = 8
# Never fewer candidates: torch's softmax over a row shorter than its vector width (16 floats with
# AVX-512) rounds differently, and a top-k row's probabilities must not depend on the width.
MIN_CANDIDATES = 64


@dataclass
class SampleOutput:
    """One chosen token per row. The tensors stay on the device (the batch feeds `chosen` to the next
    forward); the host reads them once, all together (`_host`), when the rows' events are built."""

    chosen: torch.Tensor  # [rows] long: the chosen token ids
    chosen_logprobs: torch.Tensor  # [rows] float: their logprobs
    top_n: list[int]  # per row: how many best alternatives to report
    top_values: torch.Tensor | None = None  # [rows, max(top_n)] logprobs, best first; None when no row asks
    top_ids: torch.Tensor | None = None  # [rows, max(top_n)] their token ids

    @cached_property
    def _host(self) -> list[list[float]]:
        """Per row: [id, logprob, top ids..., top logprobs...], read from the device in one `.tolist()`
        (a read is a host sync on a GPU). float64 holds every token id and every float32 logprob
        exactly, so the values are those that reading each tensor on its own would give."""
        parts = [self.chosen[:, None], self.chosen_logprobs[:, None]]
        if self.top_ids is not None:
            parts += [self.top_ids, self.top_values]
        return torch.cat([part.to(torch.float64) for part in parts], dim=1).tolist()

    @cached_property
    def token_ids(self) -> list[int]:
        return [int(row[0]) for row in self._host]

    @cached_property
    def logprobs(self) -> list[float]:
        return [row[1] for row in self._host]

    @cached_property
    def top(self) -> list[list[tuple[int, float]]]:
        """Per row: the n best (id, logprob), n from `top_n`."""
        if self.top_ids is None:
            return [[] for _ in self.top_n]
        width = self.top_ids.shape[1]
        return [[(int(t), v) for t, v in zip(row[2:2 + n], row[2 + width:2 + width + n])]
                for row, n in zip(self._host, self.top_n)]


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32, device=device)[:, None]


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.long, device=device)


def _widths(first: int, vocab: int) -> list[int]:
    """The candidate-set widths a top-k / top-p row tries, in turn, before sorting its whole row."""
    widths = [first] if first < vocab else []
    while widths and widths[-1] * WIDEN <= vocab // WIDEN:
        widths.append(widths[-1] * WIDEN)
    return widths


def _typical(scores: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy."""
    logp = torch.log_softmax(scores, dim=-1)
    p = logp.exp()
    entropy = -(p * torch.nan_to_num(logp, neginf=0.0)).sum(dim=-1, keepdim=True)
    distance = (-logp - entropy).abs()
    order = torch.argsort(distance, dim=-1)
    sorted_p = p.gather(-1, order)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    drop_sorted = before >= typical_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def _draw(probs: torch.Tensor, uniform: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """One token per row: `uniform` ([rows]) inverted through the CDF of `probs` in token-id order.
    `ids` ([rows, n], any order) names the tokens of `probs`; None: `probs` covers the vocabulary.

    Draw in token-id order, not in probability order: among 49k tokens many have near-equal scores,
    and the last-bit differences a different batch makes in the logits reorder them, so a draw in
    sorted order picked another token for ~1 in 5 seeds (a seed replayed alone diverged from the
    same seed in a batch). In id order the same noise moves each boundary by ~1e-7 of the mass.
    Tokens a row dropped carry probability 0 and add nothing to the CDF, so it is bitwise the CDF
    over the whole vocabulary with zeros at the tokens not listed."""
    if ids is not None:
        ids, order = ids.sort(dim=-1)
        probs = probs.gather(-1, order)
    cdf = probs.cumsum(dim=-1)
    # The first token whose cumulative mass reaches the target. Only a target of exactly 0 could
    # land on a token of probability 0 (the first listed), so a draw of 0 aims just above it.
    target = (uniform[:, None] * cdf[:, -1:]).clamp(min=torch.finfo(cdf.dtype).tiny)
    position = torch.searchsorted(cdf, target).clamp(max=cdf.shape[-1] - 1)
    return position.squeeze(-1) if ids is None else ids.gather(-1, position).squeeze(-1)


class HeterogeneousSampler:
    def __init__(self, params: Sequence[SamplingParams], device: torch.device, vocab_size: int,
                 top_n: Sequence[int] | None = None, generators: Sequence[torch.Generator | None] | None = None):
        self.params = list(params)
        self.device = device
        self.vocab_size = vocab_size
        self.top_n = list(top_n) if top_n is not None else [0] * len(self.params)
        self.generators = list(generators) if generators is not None else [self._generator(p) for p in self.params]
        self._rebuild()

    @staticmethod
    def _generator(p: SamplingParams) -> torch.Generator | None:
        if not p.do_sample:
            return None
        gen = torch.Generator(device="cpu")
        gen.manual_seed(p.seed if p.seed is not None else random.getrandbits(63))
        return gen

    def _rebuild(self) -> None:
        """Batch tensors of the per-row parameters; called only when rows join or leave. The
        sampled rows' tensors have one row per sampled row; `*_rows` are positions among them."""
        rows, dev, vocab = self.params, self.device, self.vocab_size
        self.sample_rows = [i for i, p in enumerate(rows) if p.do_sample]
        self.greedy_rows = [i for i, p in enumerate(rows) if not p.do_sample]
        self._sample_index, self._greedy_index = _index(self.sample_rows, dev), _index(self.greedy_rows, dev)
        self.repetition = _column([p.repetition_penalty for p in rows], dev) \
            if any(p.repetition_penalty != 1.0 for p in rows) else None
        self.presence = _column([p.presence_penalty for p in rows], dev) \
            if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in rows) else None
        self.frequency = _column([p.frequency_penalty for p in rows], dev) if self.presence is not None else None
        sampled = [rows[i] for i in self.sample_rows]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in sampled]  # 0: none
        self.temperature = _column([max(p.temperature, 1e-5) for p in sampled], dev)
        self.top_k = torch.tensor([k or vocab for k in top_k], dtype=torch.long, device=dev)[:, None]
        self.top_p = _column([p.top_p for p in sampled], dev)
        self.min_p_rows = [j for j, p in enumerate(sampled) if p.min_p > 0]
        self.min_p = _column([sampled[j].min_p for j in self.min_p_rows], dev) if self.min_p_rows else None
        self.typical_rows = [j for j, p in enumerate(sampled) if p.typical_p < 1]
        self.typical_p = _column([sampled[j].typical_p for j in self.typical_rows], dev) if self.typical_rows else None
        self.whole_rows = [j for j, p in enumerate(sampled) if not top_k[j] and p.top_p >= 1]
        self.nucleus_rows = [j for j, p in enumerate(sampled) if top_k[j] or p.top_p < 1]
        self.widths = _widths(max([MIN_CANDIDATES] + [top_k[j] + 1 if top_k[j] else CANDIDATES
                                                      for j in self.nucleus_rows]), vocab)
        self.with_top_k = [k > 0 for k in top_k]
        self.vocabulary_softmax = not all(self.with_top_k)  # some sampled row's probabilities are over the vocabulary
        self.max_top_n = max(self.top_n, default=0)
        self.bias = None
        if any(p.logit_bias for p in rows):
            self.bias = torch.zeros((len(rows), self.vocab_size), dtype=torch.float32, device=dev)
            for i, p in enumerate(rows):
                for token_id, value in p.logit_bias:
                    if 0 <= token_id < self.vocab_size:
                        self.bias[i, token_id] = value

    @property
    def needs_token_history(self) -> bool:
        return self.repetition is not None or self.presence is not None

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the rows at `keep`, in that order."""
        self.params = [self.params[i] for i in keep]
        self.generators = [self.generators[i] for i in keep]
        self.top_n = [self.top_n[i] for i in keep]
        self._rebuild()

    def extend(self, other: "HeterogeneousSampler") -> None:
        """Append `other`'s rows after this sampler's (batch concatenation)."""
        self.params += other.params
        self.generators += other.generators
        self.top_n += other.top_n
        self._rebuild()

    def _penalise(self, scores: torch.Tensor, seen: torch.Tensor | None, counts: torch.Tensor | None) -> torch.Tensor:
        if self.repetition is not None and seen is not None:
            penalised = torch.where(scores < 0, scores * self.repetition, scores / self.repetition)
            scores = torch.where(seen, penalised, scores)
        if self.presence is not None and counts is not None:
            counts = counts.to(scores.dtype)
            scores = scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts
        return scores

    def _tempered(self, scores: torch.Tensor) -> torch.Tensor:
        """The sampled rows' scores from the batch's penalised `scores`: over the temperature, and
        -inf where min-p or typical-p drop a token (only on the rows that use them)."""
        sampled = scores if len(self.sample_rows) == len(scores) else scores[self._sample_index]
        scores = sampled / self.temperature
        if self.min_p is not None:
            rows = _index(self.min_p_rows, scores.device)
            probs = torch.softmax(scores[rows], dim=-1)
            floor = self.min_p * probs.max(dim=-1, keepdim=True).values
            scores[rows] = scores[rows].masked_fill(probs < floor, float("-inf"))
        if self.typical_p is not None:
            rows = _index(self.typical_rows, scores.device)
            scores[rows] = _typical(scores[rows], self.typical_p)
        return scores

    def _distributions(self, scores: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """The sampled rows' filtered distributions from the batch's penalised `scores`, in groups of
        (positions among the sampled rows, probabilities, their token ids or None: the vocabulary)."""
        scores = self._tempered(scores)
        vocabulary = torch.softmax(scores, dim=-1) if self.vocabulary_softmax else None
        groups = []
        if self.whole_rows:
            rows = _index(self.whole_rows, scores.device)
            groups.append((rows, vocabulary[rows], None))
        pending, unsorted = self.nucleus_rows, []
        for width, wider in zip(self.widths, self.widths[1:] + [self.vocab_size]):
            if not pending:
                break
            rows = _index(pending, scores.device)
            values, ids = torch.topk(scores if len(pending) == len(scores) else scores[rows], width, dim=-1)
            probs, least = self._nucleus(pending, rows, values, ids, vocabulary)
            # 0: the candidates do; 1: `wider` might; 2: only the sort will (the only read back to the host)
            fate = ((least > width).long() + (least > wider).long()).tolist()
            if 0 in fate:
                fits = torch.tensor([f == 0 for f in fate], device=scores.device)
                groups.append((rows[fits], probs[fits], ids[fits]))
            unsorted += [row for row, f in zip(pending, fate) if f == 2]
            pending = [row for row, f in zip(pending, fate) if f == 1]
        if pending or unsorted:
            pending = sorted(pending + unsorted)
            rows = _index(pending, scores.device)
            values, ids = torch.sort(scores if len(pending) == len(scores) else scores[rows], dim=-1, descending=True)
            probs, _ = self._nucleus(pending, rows, values, ids, vocabulary)
            groups.append((rows, torch.zeros_like(probs).scatter_(-1, ids, probs), None))
        return groups

    def _probabilities(self, pending: list[int], rows: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                       vocabulary: torch.Tensor | None) -> torch.Tensor:
        """The probabilities of the best-first candidates (`values`, `ids`) of the sampled rows at
        `pending` (`rows` on the device): the softmax over the top k, without top-k over the vocabulary.
        The softmax of a best-first row is the same, bit for bit, whatever the number of -inf after
        it, so a top-k row's are the full sort's."""
        with_top_k = [self.with_top_k[j] for j in pending]
        if not all(with_top_k):
            whole = (vocabulary if len(pending) == len(vocabulary) else vocabulary[rows]).gather(-1, ids)
            if not any(with_top_k):
                return whole
        top_k = self.top_k[rows]
        ranks = torch.arange(values.shape[-1], device=values.device)
        probs = torch.softmax(values.masked_fill(ranks >= top_k, float("-inf")), dim=-1)
        return probs if all(with_top_k) else torch.where(top_k < self.vocab_size, probs, whole)

    def _nucleus(self, pending: list[int], rows: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                 vocabulary: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k and top-p on the best-first candidates (`values`, `ids`: [rows, width]) of the
        sampled rows at `pending`: (their probabilities, 0 where dropped; [rows] the fewest candidates
        that give the row what a sort of its whole row would: at most `width` when these do)."""
        width = values.shape[-1]
        probs = self._probabilities(pending, rows, values, ids, vocabulary)
        mass = probs.cumsum(dim=-1)
        top_p = self.top_p[rows]
        # Drop a token once the mass before it already reaches top_p; the best token always stays.
        kept_probs = probs.masked_fill(mass - probs >= top_p, 0.0)
        # The kept tokens are a best-first prefix, and those after the candidates would have been
        # dropped if one candidate was; unless the last kept and the first dropped score the same,
        # whose order is the sort's own (no candidate set will do). When every candidate is kept, the
        # next token may be kept too, or score the same as the last: at least one more, and as many
        # as the rest of top_p's mass over the last one's probability.
        kept = (kept_probs > 0).sum(dim=-1, keepdim=True)
        last, after = values.gather(-1, (kept - 1).clamp(min=0)), values.gather(-1, kept.clamp(max=width - 1))
        more = width + ((top_p - mass[:, -1:]) / probs[:, -1:]).clamp(min=1)
        least = torch.where(kept < width, torch.where(last > after, kept.float(), float("inf")), more)
        return kept_probs, least.squeeze(-1)

    def _sample(self, scores: torch.Tensor) -> torch.Tensor:
        """One token per sampled row, from the batch's penalised `scores`."""
        uniform = torch.stack([torch.rand((), generator=self.generators[r]) for r in self.sample_rows])
        uniform = uniform.to(scores.device)
        chosen = torch.empty(len(self.sample_rows), dtype=torch.long, device=scores.device)
        for rows, probs, ids in self._distributions(scores):
            chosen[rows] = _draw(probs, uniform[rows], ids)
        return chosen

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor | None = None,
                 counts: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                 step_bias: torch.Tensor | None = None) -> SampleOutput:
        """Choose one token per row. `seen` ([rows, vocab] bool: prompt + generated tokens) and
        `counts` ([rows, vocab]: generated-token counts) are needed when `needs_token_history`;
        `allowed` ([rows, vocab] bool) masks what a row may not choose now; `step_bias` ([rows,
        vocab]) is added with the logit biases (this step's watermark green lists)."""
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        scores = self._penalise(logits, seen, counts)
        if self.bias is not None:
            scores = scores + self.bias
        if step_bias is not None:
            scores = scores + step_bias
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        chosen = torch.empty(len(self.params), dtype=torch.long, device=logits.device)
        if self.greedy_rows:  # copying the greedy rows out costs more than their argmax: not when all are
            greedy = scores if len(self.greedy_rows) == len(scores) else scores[self._greedy_index]
            chosen[self._greedy_index] = greedy.argmax(dim=-1)
        if self.sample_rows:
            chosen[self._sample_index] = self._sample(scores)
        picked = logprobs.gather(1, chosen[:, None]).squeeze(1)
        if not self.max_top_n:
            return SampleOutput(chosen, picked, self.top_n)
        values, ids = torch.topk(logprobs, self.max_top_n, dim=-1)
        return SampleOutput(chosen, picked, self.top_n, values, ids)
