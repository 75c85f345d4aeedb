"""Beam search as rows of the rolling batch: one token per scheduler step, interleaved with the batch.

A `BeamSearch` job owns a KV batch of its own, made by the scheduler's KV factory (kv/protocol.py): the prompt
is prefilled as one row, `keep([0] * k)` replicates it into k beams, and every step feeds the beams'
tokens, runs one forward of k rows and reorders the beams with `keep(parents)`. The scheduler steps
each running job once per step, after the batch's decode (scheduler.py), so a stream waits one k-row
forward for a beam search, not the whole search.

The search is transformers' `generate(num_beams=k, num_return_sequences=k, do_sample=False)`
(`GenerationMixin._beam_search`, transformers 5.x), step for step, on the same tensors:
1. log-softmax of each beam's logits (fp32), then the repetition penalty over what the beam has seen
   (prompt or decoder prompt, plus its tokens), added to the beam's running score; at the first step
   only beam 0 counts (the others start at -1e9);
2. the best `max(2, 1 + len(eos)) * k` candidates across beams (`topk`);
3. a candidate "hits" when its token is an EOS token or it reaches max_new_tokens;
4. the next running beams: the k best candidates, a hit pushed down by -1e9;
5. the finished hypotheses: a hit among the k best candidates, scored by its sum of logprobs divided
   by (its generated length) ** length_penalty, competes with the k kept so far (nothing is added
   once the early-stop heuristic says no running beam can improve on them, or, with
   `early_stopping=True`, once all k are filled);
6. the search ends when the heuristic is satisfied (the best running beam, scored at its current
   length, is no better than the worst finished one), when every candidate hit, or (with
   `early_stopping=True`) when k hypotheses are finished.
`length_penalty` and `early_stopping` are the model's generation config's, as `generate` reads them;
its other logits processors (no_repeat_ngram_size, min_length, ...) are not applied, as in the
rolling batch. The result: the k finished hypotheses, best first; `replay` turns each into a
GenerationResult through the Row logic (stop strings, EOS, detokenization).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import torch

from lmi_serve.engine.batch import make_row
from lmi_serve.engine.kv.protocol import KVBatch, KVLayout
from lmi_serve.engine.types import FinishReason, GenerationRequest, GenerationResult

NEG = -1.0e9  # transformers' "impossible" score; finite, so sums with it stay ordered


@dataclass(frozen=True)
class Hypothesis:
    """One beam: its generated tokens and each token's logprob (after the repetition penalty)."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()

    def plus(self, token: int, logprob: float) -> "Hypothesis":
        return Hypothesis(self.tokens + (token,), self.logprobs + (logprob,))


def stop_token_ids(request: GenerationRequest) -> list[int]:
    """The tokens that end a beam: EOS (unless ignored) and the request's stop tokens."""
    stop = request.stop
    ids = stop.stop_token_ids if stop.ignore_eos else stop.eos_token_ids | stop.stop_token_ids
    return sorted(ids)


def generation_setting(model: Any, name: str, default: Any) -> Any:
    value = getattr(getattr(model, "generation_config", None), name, None)
    return default if value is None else value


class BeamState:
    """The search itself (steps 1-6 of the module docstring), apart from the model: `choose` takes
    each running beam's logits and says which beam each next running beam continues."""

    def __init__(self, num_beams: int, max_new_tokens: int, eos: list[int], seen: list[int], *,
                 repetition_penalty: float = 1.0, length_penalty: float = 1.0, early_stopping: bool | str = False):
        k = self.k = num_beams
        self.max_new_tokens = max_new_tokens
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.keep_candidates = max(2, 1 + len(eos)) * k
        self.penalty = repetition_penalty
        self.seen = torch.tensor([list(seen)] * k, dtype=torch.long)  # [k, seen so far]: the penalty's input
        self.running = [Hypothesis()] * k
        self.running_scores = torch.tensor([0.0] + [NEG] * (k - 1))
        self.finished: list[Hypothesis | None] = [None] * k
        self.finished_scores = torch.full((k,), NEG)
        self.is_finished = torch.zeros(k, dtype=torch.bool)
        self.improvable = True  # the early-stop heuristic is not satisfied yet
        self.generated = 0  # tokens each running beam has
        self.done = False

    def choose(self, logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """One step from `logits` ([k, vocab], or [1, vocab] at the first step: every beam is the
        prompt). Returns each new running beam's parent and its token ([k]); sets `done` when the
        search ended (then the caller runs no more forwards)."""
        log_probs = self._log_probs(logits.expand(self.k, -1))
        vocab = log_probs.shape[-1]
        totals = (log_probs + self.running_scores[:, None]).reshape(-1)
        top_scores, top_index = torch.topk(totals, k=self.keep_candidates)
        parents, tokens = top_index // vocab, top_index % vocab
        picked_logprobs = log_probs.reshape(-1)[top_index].tolist()
        candidates = [self.running[p].plus(t, lp) for p, t, lp in zip(parents.tolist(), tokens.tolist(),
                                                                         picked_logprobs)]
        hits = torch.isin(tokens, self.eos) | (self.generated + 1 >= self.max_new_tokens)
        next_index = self._next_running(top_scores, hits, candidates, parents, tokens)
        self._update_finished(top_scores, hits, candidates)
        self.generated += 1
        self._check_early_stop()
        exists_open = not (bool(self.is_finished.all()) and self.early_stopping is True)
        self.done = not (self.improvable and exists_open and not bool(hits.all()))
        return parents[next_index].tolist(), tokens[next_index]

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(logits.to(dtype=torch.float32), dim=-1)
        if self.penalty != 1.0:  # transformers' RepetitionPenaltyLogitsProcessor, on the log-probs
            seen = self.seen.to(log_probs.device)
            score = torch.gather(log_probs, 1, seen)
            score = torch.where(score < 0, score * self.penalty, score / self.penalty)
            log_probs = log_probs.scatter(1, seen, score)
        return log_probs.cpu()

    def _next_running(self, top_scores, hits, candidates, parents, tokens) -> torch.Tensor:
        """Step 4: the k best candidates that did not hit become the running beams."""
        running_scores = top_scores + hits.to(torch.float32) * NEG
        next_index = torch.topk(running_scores, k=self.k)[1]
        self.running = [candidates[i] for i in next_index.tolist()]
        self.running_scores = running_scores[next_index]
        if self.penalty != 1.0:
            self.seen = torch.cat([self.seen[parents[next_index]], tokens[next_index, None]], dim=1)
        return next_index

    def _update_finished(self, top_scores, hits, candidates) -> None:
        """Step 5: hits among the k best candidates, length-normalised, compete with the finished."""
        just_finished = hits.clone()
        just_finished[self.k:] = False
        scores = top_scores / ((self.generated + 1) ** self.length_penalty)
        if bool(self.is_finished.all()) and self.early_stopping is True:
            scores = scores + NEG
        if not self.improvable:
            scores = scores + NEG
        scores = scores + (~just_finished).to(torch.float32) * NEG
        merged_scores = torch.cat([self.finished_scores, scores])
        merged = self.finished + candidates
        merged_finished = torch.cat([self.is_finished, just_finished])
        best = torch.topk(merged_scores, k=self.k)[1]
        self.finished = [merged[i] for i in best.tolist()]
        self.finished_scores, self.is_finished = merged_scores[best], merged_finished[best]

    def _check_early_stop(self) -> None:
        """Step 6's heuristic: can the best running beam still beat the worst finished one?"""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_new_tokens
        else:
            length = self.generated
        best_running = self.running_scores[0] / (length ** self.length_penalty)
        worst = torch.where(self.is_finished, self.finished_scores.min(), torch.tensor(NEG))
        self.improvable = self.improvable and bool((best_running > worst).any())

    def hypotheses(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (slots never filled, possible only with a tiny
        vocabulary, are left out)."""
        return [h for h in self.finished if h is not None]


class BeamSearch:
    """A `num_beams` request as a job of the scheduler: `step()` advances every beam one token (the
    first step prefills the prompt); the result, once done, arrives on `future` as the finished
    Hypotheses, best first. `rows` is how many batch rows it counts against max_batch_size."""

    def __init__(self, request: GenerationRequest, num_beams: int, model: Any, kv_layout: KVLayout, *,
                 pad_id: int, device: torch.device):
        if num_beams < 1:
            raise ValueError(f"num_beams must be at least 1, not {num_beams}")
        self.request, self.rows = request, num_beams
        self._model, self._layout, self._pad_id, self._device = model, kv_layout, pad_id, device
        self._kv: KVBatch | None = None
        self._state: BeamState | None = None
        self.future: Future = Future()
        self.cancelled = False

    @property
    def prompt_pending(self) -> int:
        """Prompt tokens its next step prefills: all of them before its first step, then none."""
        return len(self.request.prompt_ids) if self._state is None else 0

    def cancel(self) -> None:
        """Ask the scheduler to drop this job at its next step (its rows are freed then)."""
        self.cancelled = True
        self.future.cancel()

    def release(self) -> None:
        """Free the KV batch now (the scheduler drops a cancelled or failed job; the caller may
        still hold it)."""
        self._kv = None

    def step(self) -> bool:
        """One forward (the prompt's at first, then k rows of one token) and one beam step; True
        when the search ended (the KV batch is released then)."""
        if self._kv is None:
            logits = self._prefill()
        else:
            logits = self._kv.decode()
        parents, tokens = self._state.choose(logits)
        if self._state.done:
            self.release()
            return True
        if len(self._kv) == 1:  # the first step: every beam continues the prompt's one row
            parents = [0] * self.rows
        if parents != list(range(len(self._kv))):
            self._kv.keep(parents)
        self._kv.feed(tokens.to(self._device))
        return False

    def _prefill(self) -> torch.Tensor:
        out = self._layout.prefill(self._model, [self.request.prompt_ids], pad_id=self._pad_id, device=self._device)
        self._kv = out.kv
        seen = out.seen[0] if out.seen is not None else self.request.prompt_ids
        self._state = BeamState(
            self.rows, self.request.stop.max_new_tokens, stop_token_ids(self.request), list(seen),
            repetition_penalty=self.request.sampling.repetition_penalty,
            length_penalty=generation_setting(self._model, "length_penalty", 1.0),
            early_stopping=generation_setting(self._model, "early_stopping", False))
        return out.logits

    def hypotheses(self) -> list[Hypothesis]:
        return self._state.hypotheses()


def replay(request: GenerationRequest, tokenizer, hypotheses: list[Hypothesis]) -> list[GenerationResult]:
    """Each hypothesis through the Row logic, as the rolling batch emits tokens: stop strings, EOS
    and detokenization behave the same; a beam the search ended without a stop ends with LENGTH."""
    results = []
    for hypothesis in hypotheses:
        row = make_row(request, tokenizer)
        result = GenerationResult(len(request.prompt_ids))
        for token, logprob in zip(hypothesis.tokens, hypothesis.logprobs):
            if row.finished:
                break
            result.events.append(row.advance(token, logprob, []))
        if result.events and not row.finished:  # the search ended it first: say so, keep held-back text
            last = result.events[-1]
            result.events[-1] = replace(last, text=last.text + row.detokenizer.flush(),
                                        finish_reason=FinishReason.LENGTH)
        results.append(result)
    return results
