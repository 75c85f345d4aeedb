"""The test oracle for beam search: transformers' own `generate(num_beams=k)`, its beams replayed
through the Row logic (the engine's implementation until beams ran inside the rolling batch; the
engine's beams/rows.py must return exactly these beams)."""

from __future__ import annotations

from dataclasses import replace

import torch

from lmi_serve.engine.batch import make_row
from lmi_serve.engine.kv.encdec import decoder_prompt
from lmi_serve.engine.kv.select import is_encoder_decoder
from lmi_serve.engine.types import FinishReason, GenerationRequest, GenerationResult


def reference_beam_search(model, tokenizer, device, request: GenerationRequest, num_beams: int) -> list[GenerationResult]:
    """All `num_beams` finished beams, best first (transformers' beam score order)."""
    prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=device)
    # An encoder-decoder model's sequences are the decoder's: they start with its decoder prompt.
    encoder_decoder = is_encoder_decoder(model)
    start = decoder_prompt(model) if encoder_decoder else request.prompt_ids
    extra = {"decoder_input_ids": torch.tensor([start], dtype=torch.long, device=device)} if encoder_decoder else {}
    stop = request.stop
    eos = sorted(stop.eos_token_ids | stop.stop_token_ids) if not stop.ignore_eos else sorted(stop.stop_token_ids)
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), num_beams=num_beams,
                             num_return_sequences=num_beams, do_sample=False, max_new_tokens=stop.max_new_tokens,
                             repetition_penalty=request.sampling.repetition_penalty, eos_token_id=eos or None,
                             pad_token_id=tokenizer.pad_token_id, output_scores=True, return_dict_in_generate=True,
                             forced_eos_token_id=None, **extra)
        scores = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    results = []
    for sequence, token_scores, beams in zip(out.sequences.tolist(), scores.tolist(), out.beam_indices.tolist()):
        row = make_row(request, tokenizer)
        result = GenerationResult(len(request.prompt_ids))
        generated = sequence[len(start):]
        for token, logprob, beam in zip(generated, token_scores, beams):
            if beam < 0 or row.finished:  # padding after this beam ended
                break
            result.events.append(row.advance(token, logprob, []))
        if result.events and not row.finished:  # generate ended it first: say so, keep held-back text
            last = result.events[-1]
            result.events[-1] = replace(last, text=last.text + row.detokenizer.flush(), finish_reason=FinishReason.LENGTH)
        results.append(result)
    return results
