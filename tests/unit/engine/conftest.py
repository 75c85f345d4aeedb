"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def prompt_ids(request, smollm2_tokenizer):
    """The test module's PROMPTS as token ids (no special tokens); their lengths must all differ,
    so that batching them really exercises padding."""
    ids = [tuple(smollm2_tokenizer.encode(p, add_special_tokens=False)) for p in request.module.PROMPTS]
    assert len({len(i) for i in ids}) == len(ids), "test premise: all prompt lengths differ"
    return ids
