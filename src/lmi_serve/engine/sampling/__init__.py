"""From logits to the next token: the sampler and what it reads (history, masks, grammars, watermark)."""
