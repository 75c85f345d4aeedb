"""Where the engine's tensors live on a GPU machine today: the loader's placement puts a one-GPU model
on cuda:0; the slot cache's buffers, the logits and the sampled ids stay on the model's device, and the
cache's memory is the device's (it grows with rows and goes back when they leave)."""

from __future__ import annotations

import torch

from engine_prompts import PROMPTS
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.slots import SLOTS
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams
from lmi_serve.model.loader import choose_placement


def test_the_loader_places_a_one_gpu_model_on_cuda_0(cuda):
    placement = choose_placement("auto", None, 1)
    if cuda.type == "cuda":
        assert placement.device == torch.device("cuda:0")


def test_slot_cache_logits_and_ids_stay_on_the_device(models, tokenizer, cuda):
    _, model = models("random-smollm2")
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:3]]
    synchronize = torch.cuda.synchronize if cuda.type == "cuda" else (lambda: None)
    allocated = torch.cuda.memory_allocated if cuda.type == "cuda" else (lambda: 0)
    synchronize()
    before = allocated()
    prefilled = SLOTS.prefill(model, prompts, pad_id=tokenizer.pad_token_id, device=cuda)
    kv = prefilled.kv
    assert prefilled.logits.device.type == cuda.type
    held = kv.held_bytes()
    assert held > 0
    if cuda.type == "cuda":
        assert allocated() - before >= held, "the KV buffers are not in the device's memory"
    kv.feed(prefilled.logits.argmax(-1))
    logits = kv.decode()
    assert logits.device.type == cuda.type and logits.shape[0] == len(prompts)
    kv.keep([])
    assert kv.held_bytes() < held

    engine = Engine(model, tokenizer, cuda, kv_layout=SLOTS, max_batch_size=2, name="gpu-place").start()
    try:
        events = list(engine.submit(GenerationRequest(tuple(prompts[0]), SamplingParams(),
                                                      StopParams(max_new_tokens=4, ignore_eos=True))))
    finally:
        engine.stop()
    assert [type(e.token_id) for e in events] == [int] * 4  # emitted ids are Python ints, read off the device


def test_auto_takes_bf16_only_where_the_gpu_computes_it_natively(cuda):
    """option.dtype=auto on this GPU (issue 30): a bf16 checkpoint stays bf16 at compute capability >= 8.0,
    fp16 below; torch's own check without emulation agrees."""
    from lmi_serve.model.loader import choose_dtype

    if cuda.type != "cuda":
        return
    native = torch.cuda.get_device_capability(0) >= (8, 0)
    chosen, why = choose_dtype("auto", torch.cuda.device_count(), "bf16")
    assert chosen == (torch.bfloat16 if native else torch.float16), why
    assert torch.cuda.is_bf16_supported(including_emulation=False) == native
    assert choose_dtype("auto", torch.cuda.device_count(), None)[0] == torch.float16


def test_the_launcher_counts_the_gpus_the_workers_see(cuda):
    """server/gpus.py counts in a child Python, never initialising CUDA in the launcher."""
    import os

    from lmi_serve.server.gpus import count_gpus

    if cuda.type != "cuda":
        return
    assert count_gpus(dict(os.environ)) == torch.cuda.device_count()
    assert count_gpus({**os.environ, "CUDA_VISIBLE_DEVICES": ""}) == 0
