"""LoRA adapters in the engine (model/lora.py, engine/adapters.py), on the tiny random Llama.

- Rows without an adapter get the base model's logits bit for bit, beside rows of adapters in the
  same forward; rows of an adapter get PEFT's `PeftModel` logits for that adapter.
- In the rolling batch, requests of different adapters (and none) running together give the tokens
  each gives alone; with fewer slots than adapters (eviction and reload) too.
- Registration refuses a taken name, a rank over max_lora_rank and a folder that is no adapter;
  unknown adapters are NotFound; unregistering waits for the requests that use it.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lmi_serve.engine.adapters import AdapterExists, Adapters, lora_rows, start_adapters
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.slots import SLOTS
from lmi_serve.engine.speculation import NgramSettings, NgramSpeculation
from lmi_serve.engine.types import FinishReason, GenerationRequest, SamplingParams, StopParams
from lmi_serve.errors import InvalidRequest, NotFound
from lmi_serve.model.lora import AdapterError, LoraLinear, LoraModel, LoraWeights

from engine_prompts import PROMPTS as ALL_PROMPTS  # noqa: E402
from lora_adapters import build_adapter  # noqa: E402
from waiting import within  # noqa: E402

CPU = torch.device("cpu")
PROMPTS = ALL_PROMPTS[:6]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {name: build_adapter(tiny_model, folder, name, std=0.3) for name in ("alpha", "beta", "gamma")}


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return [tuple(smollm2_tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS]


def lora_model(tiny_model, adapter_dirs, max_loras=4, names=("alpha", "beta")):
    model = copy.deepcopy(tiny_model)
    adapters = start_adapters(model, CPU, max_loras=max_loras, max_rank=64, dtype="auto", folder=None)
    for name in names:
        adapters.register(name, str(adapter_dirs[name]))
    return model, adapters


def padded_batch(ids: list[tuple[int, ...]]):
    width = max(map(len, ids))
    input_ids = torch.tensor([[0] * (width - len(i)) + list(i) for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return input_ids, mask


def logits(model, ids, slots=None):
    input_ids, mask = padded_batch(ids)
    with torch.no_grad(), lora_rows(model, slots or [None] * len(ids)):
        return model(input_ids=input_ids, attention_mask=mask).logits


def test_rows_without_an_adapter_get_the_base_logits_bit_for_bit(tiny_model, adapter_dirs, prompt_ids):
    model, adapters = lora_model(tiny_model, adapter_dirs)
    assert any(isinstance(m, LoraLinear) for m in model.modules())
    ids = [prompt_ids[0], prompt_ids[1], prompt_ids[2], prompt_ids[3]]
    a, b = adapters.get("alpha").slot, adapters.get("beta").slot
    base = logits(tiny_model, ids)
    mixed = logits(model, ids, [None, a, None, b])
    assert torch.equal(mixed[0], base[0]) and torch.equal(mixed[2], base[2])
    assert torch.equal(logits(model, ids), base)  # no adapter at all: the wrapped model is the base model
    assert not torch.allclose(mixed[1], base[1], atol=1e-3) and not torch.allclose(mixed[3], base[3], atol=1e-3)


def test_adapter_rows_match_peft(tiny_model, adapter_dirs, prompt_ids):
    from peft import PeftModel

    model, adapters = lora_model(tiny_model, adapter_dirs)
    ids = [prompt_ids[0], prompt_ids[1], prompt_ids[2]]
    slots = {name: adapters.get(name).slot for name in ("alpha", "beta")}
    mixed = logits(model, ids, [slots["alpha"], slots["beta"], None])
    for row, name in enumerate(("alpha", "beta")):
        reference = PeftModel.from_pretrained(copy.deepcopy(tiny_model), str(adapter_dirs[name])).eval()
        expected = logits(reference, ids)[row]
        assert torch.allclose(mixed[row], expected, atol=1e-5, rtol=1e-4), name


def greedy(prompt, adapter=None, n=8) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True),
                             adapter=adapter)


def run(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    handles = [engine.submit(r) for r in requests]
    results = [within(h.result) for h in handles]
    for result in results:
        assert result.finish_reason is FinishReason.LENGTH, result.error
    return [[e.token_id for e in r.events] for r in results]


@pytest.fixture
def make_engine(smollm2_tokenizer):
    engines = []

    def make(model, adapters, **kwargs) -> Engine:
        engine = Engine(model, smollm2_tokenizer, CPU, max_batch_size=kwargs.pop("max_batch_size", 8),
                        max_queue=100, adapters=adapters, **kwargs).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


def test_mixed_adapters_in_one_batch_equal_each_request_alone(tiny_model, adapter_dirs, prompt_ids, make_engine):
    model, adapters = lora_model(tiny_model, adapter_dirs)
    engine = make_engine(model, adapters)
    choices = [None, "alpha", "beta"]
    requests = [greedy(p, choice) for p in prompt_ids for choice in choices]
    alone = [run(engine, [r])[0] for r in requests]
    together = run(engine, requests)
    assert together == alone
    by_adapter = {c: [alone[i] for i in range(len(requests)) if requests[i].adapter == c] for c in choices}
    assert len({tuple(alone[i]) for i in (0, 1, 2)}) == 3  # one prompt: base, alpha and beta differ
    base_engine_tokens = run(make_engine(tiny_model, None), [r for r in requests if r.adapter is None])
    assert base_engine_tokens == by_adapter[None]  # rows on the base model are the model without LoRA


def test_more_adapters_than_slots_evict_and_reload(tiny_model, adapter_dirs, prompt_ids, make_engine):
    model, adapters = lora_model(tiny_model, adapter_dirs, max_loras=4, names=("alpha", "beta", "gamma"))
    roomy = make_engine(model, adapters)
    requests = [greedy(p, name) for p in prompt_ids[:2] for name in ("alpha", "beta", "gamma", None)]
    expected = run(roomy, requests)
    roomy.stop()

    small, few = lora_model(tiny_model, adapter_dirs, max_loras=2, names=("alpha", "beta", "gamma"))
    # registering the third evicted the least recently used one (its weights are read again on demand)
    assert [a.name for a in few.list() if a.resident] == ["beta", "gamma"]
    engine = make_engine(small, few)
    assert run(engine, requests) == expected  # all at once: 3 adapters through 2 slots
    assert [run(engine, [r])[0] for r in requests] == expected  # one by one: each a reload
    assert sum(a.loads for a in few.list()) > 3  # some were evicted and read again
    assert sum(a.resident for a in few.list()) <= 2


def test_registration_refusals(tiny_model, adapter_dirs, tmp_path):
    model, adapters = lora_model(tiny_model, adapter_dirs, names=("alpha",))
    with pytest.raises(AdapterExists, match="alpha"):
        adapters.register("alpha", str(adapter_dirs["beta"]))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        adapters.register("empty", str(tmp_path))
    with pytest.raises(AdapterError, match="not a directory"):
        adapters.register("missing", str(tmp_path / "nowhere"))
    strict = Adapters(adapters.lora, max_loras=2, max_rank=2, dtype=torch.float32, device=CPU)
    with pytest.raises(AdapterError, match="rank 4 is over option.max_lora_rank"):
        strict.register("alpha", str(adapter_dirs["alpha"]))
    dora = tmp_path / "dora"
    dora.mkdir()
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (dora / name).write_bytes((adapter_dirs["alpha"] / name).read_bytes())
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        adapters.register("dora", str(dora))
    with pytest.raises(NotFound, match="Adapter nope is not registered"):
        adapters.get("nope")
    assert [a.name for a in adapters.list()] == ["alpha"]


def test_unknown_adapters_and_beams_are_refused(tiny_model, adapter_dirs, prompt_ids, make_engine, smollm2_tokenizer):
    model, adapters = lora_model(tiny_model, adapter_dirs, names=("alpha",))
    engine = make_engine(model, adapters)
    with pytest.raises(NotFound, match="Adapter nope is not registered"):
        engine.submit(greedy(prompt_ids[0], "nope"))
    with pytest.raises(InvalidRequest, match="Beam search with a LoRA adapter"):
        engine.submit_beams(greedy(prompt_ids[0], "alpha"), 2)
    off = make_engine(tiny_model, None)
    with pytest.raises(NotFound, match="option.enable_lora"):
        off.submit(greedy(prompt_ids[0], "alpha"))


def test_unregister_waits_for_the_requests_using_it(tiny_model, adapter_dirs, prompt_ids, make_engine):
    model, adapters = lora_model(tiny_model, adapter_dirs, names=("alpha",))
    engine = make_engine(model, adapters)
    expected = run(engine, [greedy(prompt_ids[0], "alpha", n=40)])[0]
    handle = engine.submit(greedy(prompt_ids[0], "alpha", n=40))
    adapter = adapters.unregister("alpha")
    assert adapter.removed and "alpha" not in adapters
    with pytest.raises(NotFound):
        engine.submit(greedy(prompt_ids[0], "alpha"))
    assert [e.token_id for e in within(handle.result).events] == expected  # the running one finished on it
    assert not adapter.resident and adapter.users == 0  # and then its slot was freed
    adapters.register("alpha", str(adapter_dirs["alpha"]))  # the name may be taken again
    assert run(engine, [greedy(prompt_ids[0], "alpha", n=40)])[0] == expected


def test_lora_layers_wrap_only_linear_layers_but_the_head(tiny_model):
    model = copy.deepcopy(tiny_model)
    lora = LoraModel.wrap(model)
    assert "lm_head" not in lora.layers and "model.layers.0.self_attn.q_proj" in lora.layers
    assert "model.layers.1.mlp.down_proj" in lora.layers


def test_each_layer_indexes_its_rows_on_its_own_input_device():
    """Under device_map=auto the layers live on several GPUs: a row index made once on the engine's
    device failed `index_add` on every layer elsewhere (issue 30). Each LoraLinear now asks the router
    for the index on its input's device. Here the engine's device is the CPU and the layers are on
    `meta` (no data, same device rule: index_add refuses an index from another device), standing in
    for cuda:0 and cuda:1; a GPU machine with two GPUs is what confirms it on real memory."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4, bias=False)).to("meta")
    model.get_output_embeddings = lambda: None
    lora = LoraModel.wrap(model)
    weights = {name: LoraWeights(torch.empty(2, layer.in_features, device="meta"),
                                 torch.empty(layer.out_features, 2, device="meta"), 1.0)
               for name, layer in lora.layers.items()}
    lora.install(0, weights)
    made = []
    real_index = lora.router.index

    def index(slot, rows, device):
        made.append(device)
        return real_index(slot, rows, device)

    lora.router.index = index
    with lora_rows(model, [0, None, 0]):
        out = model(torch.empty(3, 8, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 4)
    assert made == [torch.device("meta")] * 2  # each layer asked for its rows on its input's device


def test_adapters_on_stacked_onednn_layers(tiny_model, adapter_dirs, prompt_ids):
    """q/k/v and gate/up stacked into one oneDNN matmul each (kernels/layers/shared_input.py): LoRA still wraps every
    one of them, base rows keep the stacked base model's logits bit for bit, adapter rows match PEFT."""
    from peft import PeftModel

    from lmi_serve.kernels.host import onednn_available
    from lmi_serve.kernels.layers.linear_kernels import use_linear_kernel
    if not onednn_available():
        pytest.skip("this torch was built without oneDNN")
    base = copy.deepcopy(tiny_model)
    assert use_linear_kernel(base, "onednn", CPU).stacked
    model = copy.deepcopy(tiny_model)
    use_linear_kernel(model, "onednn", CPU)
    adapters = start_adapters(model, CPU, max_loras=2, max_rank=64, dtype="auto", folder=None)
    adapters.register("alpha", str(adapter_dirs["alpha"]))
    layers = {name for name, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert {"model.layers.0.self_attn.k_proj", "model.layers.0.mlp.up_proj"} <= layers
    ids = [prompt_ids[0], prompt_ids[1]]
    mixed = logits(model, ids, [adapters.get("alpha").slot, None])
    assert torch.equal(mixed[1], logits(base, ids)[1])
    reference = PeftModel.from_pretrained(copy.deepcopy(tiny_model), str(adapter_dirs["alpha"])).eval()
    assert torch.allclose(mixed[0], logits(reference, ids)[0], atol=1e-4, rtol=1e-4)


def test_an_adapter_rows_drafts_are_verified_on_its_adapter(tiny_model, adapter_dirs, prompt_ids, make_engine):
    """n-gram speculation (engine/speculation.py): `verify` runs under the row's slot, so each position's logits
    are the adapter's (those of a fresh forward of the sequence so far), and the engine's output is unchanged."""
    model, adapters = lora_model(tiny_model, adapter_dirs)
    SLOTS.prepare(model)
    slot = adapters.get("alpha").slot
    prompt = list(prompt_ids[2])
    with lora_rows(model, [slot]):
        kv = SLOTS.prefill(model, [prompt], pad_id=0, device=CPU).kv
        kv.feed(torch.tensor([11]))
        verified = kv.verify([12, 13])
    for position, fed in enumerate(([11], [11, 12], [11, 12, 13])):
        expected = logits(model, [tuple(prompt + fed)], [slot])[0, -1]
        assert torch.allclose(verified[position], expected, atol=1e-4), position
    assert not torch.allclose(verified[0], logits(tiny_model, [tuple(prompt + [11])])[0, -1], atol=1e-3)
    speculating = make_engine(model, adapters, speculation=NgramSpeculation(NgramSettings()))
    requests = [greedy(p, "alpha", n=24) for p in prompt_ids]
    assert [run(speculating, [r])[0] for r in requests] == [run(make_engine(model, adapters), [r])[0] for r in requests]
