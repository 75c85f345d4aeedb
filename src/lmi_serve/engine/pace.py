"""The step pace: a step's prompt-token budget from a bound on the step's seconds, on this machine.

A prefill pauses every running stream for as long as its step takes, so the step's prompt-token
budget (option.max_rolling_batch_prefill_tokens) bounds the longest gap between two tokens only in
the seconds of the machine it was chosen on: 256 tokens took ~0.2 s on one 2-core EPYC and ~0.4 s
on a slower one, where the longest gap passed 0.5 s. With a bound in seconds
(option.max_rolling_batch_step_seconds) the scheduler fits what its steps cost here and now,

    seconds = d0 + d1 x rows + d2 x context + k x prompt tokens + a x attention pairs

(rows: the decode rows; context: the tokens they attend over; a prompt token's attention pairs: the
tokens before it, prompt and prefix) by least squares with every cost >= 0 over its last steps, and
admits no more prompt tokens a step than the time its decode rows leave, `(seconds - decode) / k` (never
more than the token budget, never fewer than `MIN_TOKENS`, so a prompt always advances). `k / a` is the context at
which a prompt token's attention costs what its linear layers do: measured, it replaces the crossover
chunked.py counts from the model's shapes, which is too long on CPUs whose attention runs below their
matmuls' rate (~1,400-2,200 measured against 3,072 for SmolLM2 on a 2-core EPYC).

A stream's gap runs from one step's delivery to the next one's, so what runs between them (a beam
search's forward, scheduler.py step 8; admission) counts against the next step's seconds.

Which tokens a step admits never changes what a request generates (the batch-invariance tests), so
a budget that moves with the machine's speed moves only latency.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("lmi_serve.engine.scheduler")

MIN_TOKENS = 16  # a step's prompt tokens, however slow the machine: a prompt always advances
WINDOW = 256  # steps the fit looks back over: a few minutes of load, so it follows the machine
MIN_STEPS = 24  # steps seen before the fit is trusted
MIN_PREFILL_STEPS = 8  # of them, steps that prefilled something (k cannot be fitted from decodes alone)
REFIT_EVERY = 8  # steps between fits (a fit takes ~1 ms; a CPU step, ~0.1 s)
LOG_RATIO = 1.5  # a fitted token cost this far from the last one logged is logged again
CROSSOVER_RANGE = 4  # a fitted crossover is kept above the model's shapes' / 4 (measured: 0.37-0.75x of it)
MAX_MEDIAN_ERROR = 0.5  # a fit whose median step is off by more than this share is not used


@dataclass(frozen=True)
class StepWork:
    """What one step ran, in the fit's terms (the module docstring)."""

    rows: int  # decode rows
    context: int  # tokens the decode rows attend over, summed
    prompt_tokens: int  # prompt tokens prefilled (joiners' and the chunk's)
    attention_pairs: float  # each prompt token's count of tokens before it, summed

    def features(self) -> list[float]:
        return [1.0, self.rows, self.context, self.prompt_tokens, self.attention_pairs]


def decode_context(rows) -> int:
    """The tokens the running `rows` (engine/batch.py Row) attend over when they decode."""
    return sum(len(row.request.prompt_ids) + row.generated for row in rows)


def prompt_work(done: int, tokens: int) -> float:
    """The attention pairs of `tokens` prompt tokens prefilled after `done` (each attends over the
    ones before it): tokens x (done + tokens / 2)."""
    return tokens * (done + tokens / 2)


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares `a @ x ~ b` with every x >= 0 (every cost the fit names is one): the best of the
    unconstrained solutions on each subset of columns that come out all >= 0, which is the constrained
    optimum (it solves the unconstrained problem on its own nonzero columns). Five columns: 31 subsets,
    ~1 ms. Unconstrained, collinear columns (rows and their context; a prompt's tokens and its attention
    pairs) took opposite signs and a fitted 32-row decode of ~1 s, which starved joiners."""
    best, best_error = np.zeros(a.shape[1]), float(np.sum(b * b))
    for subset in range(1, 1 << a.shape[1]):
        columns = [i for i in range(a.shape[1]) if subset >> i & 1]
        solution = np.linalg.lstsq(a[:, columns], b, rcond=None)[0]
        if (solution < 0).any():
            continue
        error = float(np.sum((a[:, columns] @ solution - b) ** 2))
        if error < best_error:
            best, best_error = np.zeros(a.shape[1]), error
            best[columns] = solution
    return best


class StepPace:
    """Fits the steps' costs and turns a step's `seconds` into its prompt-token budget."""

    def __init__(self, seconds: float, *, prior_crossover: float, clock=time.perf_counter):
        """`seconds` (> 0): what a step that prefills may take; `prior_crossover`: the crossover until
        one is measured (chunked.attention_crossover); `clock`: seconds, monotonic."""
        if not seconds > 0:
            raise ValueError(f"a step pace needs seconds > 0, not {seconds}")
        self.seconds = seconds
        self.prior_crossover = prior_crossover
        self.clock = clock
        self._steps: collections.deque[tuple[list[float], float]] = collections.deque(maxlen=WINDOW)
        self._since_fit = 0
        self.token_seconds: float | None = None  # k: a prompt token's linear-layer seconds, once fitted
        self._decode = (0.0, 0.0, 0.0)  # d0, d1, d2: a step's seconds without its prompts, once fitted
        self.crossover = prior_crossover  # k / a once fitted (a > 0), else the prior
        self._logged_k: float | None = None
        self._ended: float | None = None  # when the last observed step delivered its tokens
        self._settled = False  # a fit over a full window was logged

    def observe(self, work: StepWork, seconds: float) -> None:
        """Learn from one step that ran `work` in `seconds` (by `clock`), its tokens delivered now."""
        self._ended = self.clock()
        self._steps.append((work.features(), seconds))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            self._fit()

    def tokens(self, most: int, rows: int, context: int) -> int:
        """The prompt-token budget of a step decoding `rows` rows over `context` tokens: what fits the
        seconds they leave at the fitted costs, within [MIN_TOKENS, `most`]; `most` until the fit is
        trusted. The rows' gap began when the last step delivered: what ran since (a beam search's
        step, admission) counts against these seconds too."""
        if self.token_seconds is None:
            return most
        waited = self.clock() - self._ended if rows and self._ended is not None else 0.0
        spare = self.seconds - waited - self.decode_seconds(rows, context)
        return max(min(most, MIN_TOKENS), min(most, int(spare / self.token_seconds)))

    def decode_seconds(self, rows: int, context: int) -> float:
        """A step's fitted seconds without prompts (0 before the first fit)."""
        d0, d1, d2 = self._decode
        return max(d0 + d1 * rows + d2 * context, 0.0)

    def _fit(self) -> None:
        prefills = sum(1 for features, _ in self._steps if features[3] > 0)
        if len(self._steps) < MIN_STEPS or prefills < MIN_PREFILL_STEPS:
            return
        x = np.array([features for features, _ in self._steps])
        y = np.array([seconds for _, seconds in self._steps])
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0  # a column never seen (no context yet): its coefficient stays 0
        # Relative errors, so a share of a step counts the same in short and long steps (served, prefilling
        # steps took 1.06x their predicted seconds with plain least squares, 1.03x with this).
        weight = 1 / np.maximum(y, 1e-4)[:, None]
        coef = nonnegative_lstsq(x / scale * weight, y * weight[:, 0]) / scale
        k, a = float(coef[3]), float(coef[4])
        crossover = k / a if a > 0 and math.isfinite(a) else self.prior_crossover
        if crossover < self.prior_crossover / CROSSOVER_RANGE:
            # Prompts of one length move their tokens and their attention pairs together, and the fit cannot
            # tell the two apart (guidellm's 130-token chat prompts fitted crossovers of 4 to 590 tokens and a
            # 32-row decode of ~1 s, which starved joiners): fit again with the attention at the lowest
            # crossover believed, a prompt token counting 1 + its context / crossover.
            crossover = self.prior_crossover / CROSSOVER_RANGE
            x = np.column_stack([x[:, :3], x[:, 3] + x[:, 4] / crossover])
            scale = scale[:4].copy()
            scale[3] = np.abs(x[:, 3]).max() or 1.0
            coef = nonnegative_lstsq(x / scale * weight, y * weight[:, 0]) / scale
            k = float(coef[3])
        if not (math.isfinite(k) and k > 0):
            return  # noise swamped the prefills' cost: keep what was fitted before
        predicted = x @ coef
        if np.median(np.abs(predicted - y) / np.maximum(y, 1e-4)) > MAX_MEDIAN_ERROR:
            return  # the steps do not follow this model (a machine changing speed under it): keep the last fit
        self.token_seconds = k
        self._decode = (float(coef[0]), float(coef[1]), float(coef[2]))
        self.crossover = crossover
        settled = len(self._steps) == WINDOW and not self._settled  # the first fit over a whole window
        self._settled = self._settled or settled
        if settled or self._logged_k is None or not 1 / LOG_RATIO < k / self._logged_k < LOG_RATIO:
            self._logged_k = k  # the first fit, the first over a full window, a machine that changed speed
            log.info("Step pace: %.2f ms a prompt token, attention crossover %.0f tokens (%.0f from the model's "
                     "shapes); a decode of 32 rows of 200 tokens %.0f ms, %d prompt tokens beside it within %.2f s",
                     1e3 * k, self.crossover, self.prior_crossover, 1e3 * self.decode_seconds(32, 6400),
                     self.tokens(1 << 20, 32, 6400), self.seconds)
