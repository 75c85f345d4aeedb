"""The KV seam (engine/kv/protocol.py): the scheduler reaches the model only through a KVLayout and the
KVBatch verbs, the implementations (DynamicCache, slots, encoder-decoder) meet the contract that
keep/extend never change a row's logits, and each layout declares what it supports."""

from __future__ import annotations

import pytest
import torch

from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.kv import slot_part
from lmi_serve.engine.kv.dynamic import DYNAMIC, DynamicKV
from lmi_serve.engine.kv.encdec import EncoderDecoderKV, decoder_prompt
from lmi_serve.engine.kv.protocol import KVBatch, KVLayout, Prefilled
from lmi_serve.engine.kv.select import KV_LAYOUTS, choose_kv, layout_for
from lmi_serve.engine.kv.slots import SLOTS, SlotKV, merges
from lmi_serve.engine.scheduler import Scheduler
from lmi_serve.engine.types import FinishReason, GenerationRequest, SamplingParams, StopParams

from engine_prompts import PROMPTS as ALL_PROMPTS  # noqa: E402
from tiny_seq2seq import tiny_seq2seq  # noqa: E402

CPU = torch.device("cpu")
PROMPTS = ALL_PROMPTS[:5]


class CountingKV:
    """A KVBatch without a model: a row's logits always favour its last token + 1, so a greedy row
    generates last+1, last+2, ... Only the protocol's verbs exist; every call is logged."""

    vocab = 0
    log: list[str] = []

    def __init__(self, last: list[int]):
        self._last = last
        self._pending: torch.Tensor | None = None

    @classmethod
    def prefill(cls, model, prompts, *, pad_id, device, prompt_logits=False) -> Prefilled:
        assert model is None, "the scheduler hands the layout its model and never runs it itself"
        cls.log.append(f"prefill {len(prompts)}")
        kv = cls([p[-1] for p in prompts])
        return Prefilled(kv, kv._logits())

    def _logits(self) -> torch.Tensor:
        logits = torch.zeros((len(self._last), self.vocab))
        logits[torch.arange(len(self._last)), torch.tensor(self._last, dtype=torch.long) + 1] = 10.0
        return logits

    def __len__(self) -> int:
        return len(self._last)

    def feed(self, tokens: torch.Tensor) -> None:
        assert tokens.shape == (len(self),)
        self._pending = tokens

    def decode(self) -> torch.Tensor:
        self.log.append(f"decode {len(self)}")
        self._last = self._pending.tolist()
        return self._logits()

    def keep(self, indices) -> None:
        self.log.append(f"keep {list(indices)}")
        self._last = [self._last[i] for i in indices]
        self._pending = self._pending[torch.tensor(list(indices), dtype=torch.long)]

    def extend(self, other: "CountingKV") -> None:
        self.log.append(f"extend {len(other)}")
        self._last = self._last + other._last
        self._pending = torch.cat([self._pending, other._pending])


class CountingLayout(KVLayout):
    """CountingKV's layout: it declares nothing optional, so prompts go whole."""

    name = "counting"

    def prefill(self, model, prompts, **kwargs) -> Prefilled:
        return CountingKV.prefill(model, prompts, **kwargs)


@pytest.fixture(autouse=True)
def prepared(tiny_model):
    """The model attends as a server's does: its layout prepared it (engine/build.py), so a slot cache
    can keep parts."""
    SLOTS.prepare(tiny_model)


def test_the_scheduler_runs_any_kv_batch_through_the_interface(smollm2_tokenizer, prompt_ids, monkeypatch):
    assert isinstance(CountingKV([]), KVBatch)
    monkeypatch.setattr(CountingKV, "vocab", len(smollm2_tokenizer))
    monkeypatch.setattr(CountingKV, "log", [])
    scheduler = Scheduler(None, smollm2_tokenizer, CPU, max_batch_size=2, max_queue=10,
                          kv_layout=CountingLayout())
    lengths = [5, 2, 4, 3]
    requests = [GenerationRequest(p, SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True))
                for p, n in zip(prompt_ids, lengths)]
    handles = [RequestHandle(r, deadline=None) for r in requests]
    for handle in handles:
        scheduler.add(handle)
    for _ in range(20):
        scheduler.step()
        if not scheduler.waiting and not scheduler.batch:
            break
    for handle, request, n in zip(handles, requests, lengths):
        result = handle.result()
        last = request.prompt_ids[-1]
        assert [e.token_id for e in result.events] == list(range(last + 1, last + 1 + n))
        assert result.finish_reason is FinishReason.LENGTH
    # Rows left (keep) and joined (extend) while others ran; the batch never outgrew max_batch_size.
    assert any(entry.startswith("keep") for entry in CountingKV.log)
    assert any(entry.startswith("extend") for entry in CountingKV.log)
    assert all(int(entry.split()[1]) <= 2 for entry in CountingKV.log if entry.startswith(("decode", "prefill")))


def fresh_logits(model, sequences) -> torch.Tensor:
    """Each sequence's next-token logits from a new prefill of the whole sequence."""
    return DynamicKV.prefill(model, sequences, pad_id=0, device=CPU).logits


def decode_fed(kv, sequences: list[list[int]], tokens: list[int]) -> torch.Tensor:
    """Feed each row its token (appended to that row's sequence) and decode: the step's logits."""
    kv.feed(torch.tensor(tokens))
    for sequence, token in zip(sequences, tokens):
        sequence.append(token)
    return kv.decode()


def assert_fresh(model, sequences: list[list[int]], logits: torch.Tensor, where: str = "") -> None:
    """Every row's logits equal a fresh prefill of its sequence alone."""
    for sequence, row in zip(sequences, logits):
        assert torch.allclose(row, fresh_logits(model, [sequence])[0], atol=1e-4), where


@pytest.mark.parametrize("kind", sorted(KV_LAYOUTS))
def test_kv_keep_and_extend_match_a_fresh_prefill(kind, tiny_model, smollm2_tokenizer, prompt_ids):
    """After rows joined, left and decoded, every row's logits equal those of a fresh prefill of
    its prompt plus the tokens it was fed (a DynamicCache forward: `fresh_logits`)."""
    factory = KV_LAYOUTS[kind].prefill
    pad = smollm2_tokenizer.pad_token_id
    sequences = [list(p) for p in prompt_ids]
    first = factory(tiny_model, [sequences[i] for i in (4, 0, 2)], pad_id=pad, device=CPU)
    kv, order = first.kv, [4, 0, 2]
    assert isinstance(kv, KVBatch) and len(kv) == 3

    def step(tokens: list[int]) -> torch.Tensor:
        kv.feed(torch.tensor(tokens, dtype=torch.long))
        for i, token in zip(order, tokens):
            sequences[i].append(token)
        return kv.decode()

    step([101, 102, 103])
    joined = factory(tiny_model, [sequences[i] for i in (1, 3)], pad_id=pad, device=CPU)
    joined.kv.feed(torch.tensor([0, 0]))  # placeholders; the next feed sets the real ones
    kv.extend(joined.kv)
    order += [1, 3]
    logits = step([201, 202, 203, 204, 205])
    assert torch.allclose(logits, fresh_logits(tiny_model, [sequences[i] for i in order]), atol=1e-4)

    kv.keep([1, 3, 4])  # the longest prompt (4) leaves: its padding columns go too
    order = [order[i] for i in (1, 3, 4)]
    assert len(kv) == 3
    logits = step([301, 302, 303])
    assert torch.allclose(logits, fresh_logits(tiny_model, [sequences[i] for i in order]), atol=1e-4)
    for i, row in zip(order, logits):  # and each row alone
        assert torch.allclose(row, fresh_logits(tiny_model, [sequences[i]])[0], atol=1e-4)


@pytest.mark.parametrize("kind", sorted(KV_LAYOUTS))
def test_kv_held_bytes_cover_the_rows_k_v_and_follow_the_batch(kind, tiny_model, prompt_ids):
    """held_bytes() (the kv_cache_bytes metric) is at least what the rows' K/V take, grows when
    rows join, and falls to nothing when none is left."""
    config = tiny_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # K and V, fp32
    first = KV_LAYOUTS[kind].prefill(tiny_model, [list(prompt_ids[0])], pad_id=0, device=CPU)
    kv = first.kv
    alone = kv.held_bytes()
    assert alone >= per_token * len(prompt_ids[0])
    joined = KV_LAYOUTS[kind].prefill(tiny_model, [list(prompt_ids[1]), list(prompt_ids[2])], pad_id=0, device=CPU)
    kv.extend(joined.kv)
    assert kv.held_bytes() >= per_token * sum(len(p) for p in prompt_ids[:3]) and kv.held_bytes() > alone
    kv.keep([])
    assert kv.held_bytes() < alone


@pytest.mark.parametrize("kind", sorted(KV_LAYOUTS))
def test_kv_keep_with_repeated_indices_copies_rows(kind, tiny_model, prompt_ids):
    """Beam search replicates a row (`keep([0] * k)`) and reorders beams with repeats: each copy
    then decodes as its own sequence. Ten copies pass the slot cache's first row capacity (8)."""
    factory = KV_LAYOUTS[kind].prefill
    sequences = [list(prompt_ids[1]), list(prompt_ids[3])]
    kv = factory(tiny_model, sequences, pad_id=0, device=CPU).kv
    order = [1] * 6 + [0] * 4
    kv.keep(order)
    sequences = [list(sequences[i]) for i in order]
    tokens = list(range(500, 500 + len(order)))
    kv.feed(torch.tensor(tokens))
    logits = kv.decode()
    for sequence, token in zip(sequences, tokens):
        sequence.append(token)
    assert len(kv) == 10 and torch.allclose(logits, fresh_logits(tiny_model, sequences), atol=1e-4)
    kv.keep([9, 0, 0])  # repeats again, after a decode, across the two prompts
    sequences = [list(sequences[i]) for i in (9, 0, 0)]
    kv.feed(torch.tensor([7, 8, 9]))
    for sequence, token in zip(sequences, (7, 8, 9)):
        sequence.append(token)
    assert torch.allclose(kv.decode(), fresh_logits(tiny_model, sequences), atol=1e-4)


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_kv_keep_with_repeated_indices_copies_rows(kind, smollm2_tokenizer, prompt_ids):
    model = tiny_seq2seq(kind, len(smollm2_tokenizer))
    start = list(decoder_prompt(model))
    kv = EncoderDecoderKV.prefill(model, [prompt_ids[2]], pad_id=0, device=CPU).kv
    kv.keep([0, 0, 0])
    fed = [[11], [12], [13]]
    kv.feed(torch.tensor([f[-1] for f in fed]))
    kv.decode()
    kv.keep([2, 0, 2])
    fed = [fed[i] + [t] for i, t in zip((2, 0, 2), (21, 22, 23))]
    kv.feed(torch.tensor([f[-1] for f in fed]))
    with torch.inference_mode():
        fresh = torch.cat([model(input_ids=torch.tensor([prompt_ids[2]]),
                                 decoder_input_ids=torch.tensor([start + f])).logits[:, -1] for f in fed])
    assert torch.allclose(kv.decode(), fresh, atol=1e-4)


def test_dynamic_kv_prompt_logits_are_each_rows_own(tiny_model, prompt_ids):
    prompts = [prompt_ids[1], prompt_ids[4]]
    out = DynamicKV.prefill(tiny_model, prompts, pad_id=0, device=CPU, prompt_logits=True)
    assert [t.shape[0] for t in out.prompt_logits] == [len(p) for p in prompts]
    with torch.inference_mode():
        alone = tiny_model(input_ids=torch.tensor([prompts[0]])).logits[0]
    assert torch.allclose(out.prompt_logits[0], alone, atol=1e-4)
    assert torch.allclose(out.logits, torch.stack([t[-1] for t in out.prompt_logits]))
    assert DynamicKV.prefill(tiny_model, prompts, pad_id=0, device=CPU).prompt_logits is None


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_kv_keep_and_extend_match_a_fresh_forward(kind, smollm2_tokenizer, prompt_ids):
    """The same contract for kv/encdec.py: after rows joined (decoder columns left-padded, prompt
    columns right-padded), left and decoded, every row's logits equal one unpadded forward of its
    prompt through the encoder and its decoder prompt plus the tokens it was fed."""
    model = tiny_seq2seq(kind, len(smollm2_tokenizer))
    start = list(decoder_prompt(model))
    fed: dict[int, list[int]] = {i: [] for i in range(len(prompt_ids))}

    def fresh(order: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat([model(input_ids=torch.tensor([prompt_ids[i]]),
                                    decoder_input_ids=torch.tensor([start + fed[i]])).logits[:, -1] for i in order])

    first = EncoderDecoderKV.prefill(model, [prompt_ids[i] for i in (4, 0, 2)], pad_id=0, device=CPU)
    kv, order = first.kv, [4, 0, 2]
    assert isinstance(kv, KVBatch) and first.seen == [tuple(start)] * 3
    assert torch.allclose(first.logits, fresh(order), atol=1e-4)

    def step(tokens: list[int]) -> torch.Tensor:
        kv.feed(torch.tensor(tokens, dtype=torch.long))
        for i, token in zip(order, tokens):
            fed[i].append(token)
        return kv.decode()

    step([101, 102, 103])
    joined = EncoderDecoderKV.prefill(model, [prompt_ids[i] for i in (1, 3)], pad_id=0, device=CPU)
    kv.extend(joined.kv)
    order += [1, 3]
    assert torch.allclose(step([201, 202, 203, 204, 205]), fresh(order), atol=1e-4)
    width = kv.enc_mask.shape[1]
    kv.keep([1, 3, 4])  # the longest prompt (4) leaves: its prompt columns go too
    order = [order[i] for i in (1, 3, 4)]
    assert len(kv) == 3 and kv.enc_mask.shape[1] == max(len(prompt_ids[i]) for i in order) < width
    assert torch.allclose(step([301, 302, 303]), fresh(order), atol=1e-4)


@pytest.fixture(params=["fresh", "nan"])
def slot_buffers(request, monkeypatch):
    """Slot buffers as allocated (fresh memory), or filled with NaN: a buffer's memory that no row has
    written must never be read (it is left uninitialised), else NaN reaches the logits."""
    if request.param == "nan":
        def poisoned(shape, like):
            return torch.full(tuple(shape), float("nan"), dtype=like.dtype, device=like.device)

        monkeypatch.setattr(slot_part, "new_buffer", poisoned)
    return request.param


def test_slot_kv_logits_are_bitwise_the_dynamic_caches(tiny_model, prompt_ids, monkeypatch, slot_buffers):
    """In one part, same layout, same forward: only where K/V are stored differs, so the logits are
    identical, through joins (both directions of padding), leaves and growth past the first column
    capacity."""
    monkeypatch.setattr(SlotKV, "merge_slack", 10**9)  # every joiner merges: one part
    # Both caches attend through one function: the `prepared` fixture's, as a server's layout prepares it.
    runs = []
    for factory in (DynamicKV.prefill, SlotKV.prefill):
        out = factory(tiny_model, [prompt_ids[i] for i in (0, 4)], pad_id=0, device=CPU)
        kv, logits = out.kv, [out.logits]
        for step in range(300):  # past MIN_COLUMNS: the buffers grow once
            kv.feed(torch.tensor([100 + step % 50] * len(kv)))
            logits.append(kv.decode())
            if step == 3:  # a shorter joiner
                kv.extend(factory(tiny_model, [prompt_ids[2]], pad_id=0, device=CPU).kv)
            if step == 5:
                kv.keep([2, 0])
            if step == 280:  # after the buffers grew inside a forward: rows leave and join outside one
                kv.keep([1])
            if step == 290:
                kv.extend(factory(tiny_model, [prompt_ids[3]], pad_id=0, device=CPU).kv)
        runs.append(logits)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert all(torch.isfinite(x).all() for x in runs[1])


@pytest.mark.parametrize("slack", [0, 10**9], ids=["parts", "one-part"])
def test_slot_kv_reads_only_what_it_wrote(tiny_model, prompt_ids, monkeypatch, slack):
    """Buffers are left uninitialised (here: NaN): every row's logits stay finite and equal a fresh
    prefill of its sequence while shorter and over-twice-longer rows join, rows leave and buffers grow."""
    monkeypatch.setattr(slot_part, "new_buffer", lambda shape, like: torch.full(
        tuple(shape), float("nan"), dtype=like.dtype, device=like.device))
    monkeypatch.setattr(SlotKV, "merge_slack", slack)
    sequences = [list(prompt_ids[i]) for i in (0, 4)]
    kv = SlotKV.prefill(tiny_model, sequences, pad_id=0, device=CPU).kv
    joiners = {2: list(prompt_ids[2]), 4: (list(prompt_ids[1]) * 60)[:150], 9: list(prompt_ids[3])}
    for step in range(12):
        if step in joiners:
            kv.extend(SlotKV.prefill(tiny_model, [joiners[step]], pad_id=0, device=CPU).kv)
            sequences.append(list(joiners[step]))
        if step == 7:  # the first row and the long one leave
            kv.keep([1, 2])
            sequences = [sequences[i] for i in (1, 2)]
        logits = decode_fed(kv, sequences, [20 + step + i for i in range(len(sequences))])
        assert torch.isfinite(logits).all(), f"step {step}"
        assert_fresh(tiny_model, sequences, logits, f"step {step}")


def test_slot_kv_writes_in_place_and_reuses_its_buffers(tiny_model, prompt_ids):
    out = SlotKV.prefill(tiny_model, [prompt_ids[1], prompt_ids[3]], pad_id=0, device=CPU)
    kv = out.kv
    layer = kv.cache.layers[0]
    [part] = layer.parts
    store = part.key_store
    for step in range(5):
        kv.feed(torch.tensor([7, 8]))
        kv.decode()
    assert part.key_store is store  # no new buffer per step
    assert layer.keys.data_ptr() == store.data_ptr() and layer.keys.shape[2] == kv.mask.shape[1]
    kv.keep([1])
    kv.extend(SlotKV.prefill(tiny_model, [prompt_ids[0]], pad_id=0, device=CPU).kv)
    assert layer.parts == [part] and part.rows == 2  # a short joiner merged into the part
    assert part.key_store.shape[0] >= 2 and part.keys.shape[2] == kv.mask.shape[1]


def test_slot_kv_parts_attend_over_their_own_columns(tiny_model, prompt_ids, slot_buffers):
    """A long row joining short ones arrives as its own part: the short rows' buffers are neither
    copied nor widened, each row attends over its own part's columns, and every row's logits equal
    a forward of that row alone. When the long row leaves, the parts merge back into one."""
    sequences = [list(prompt_ids[i]) for i in (0, 1)]
    out = SlotKV.prefill(tiny_model, sequences, pad_id=0, device=CPU)
    kv = out.kv
    short_store = kv.cache.layers[0].parts[0].key_store
    long_prompt = (list(prompt_ids[2]) * 40)[:400]
    kv.extend(SlotKV.prefill(tiny_model, [long_prompt], pad_id=0, device=CPU).kv)
    sequences.append(long_prompt)
    rows, lengths = kv.part_shapes()
    assert rows == [2, 1] and lengths == [max(map(len, sequences[:2])), 400]
    assert kv.cache.layers[0].parts[0].key_store is short_store  # the short rows did not move
    for step in range(3):
        assert_fresh(tiny_model, sequences, decode_fed(kv, sequences, [11 + step, 12 + step, 13 + step]))
    assert kv.row_kv(2, 0, 400)[0][0].shape[1] == 400  # the prefix cache reads a row in its part
    kv.keep([0, 1])  # the long row leaves: one part again, as narrow as the short rows need
    assert kv.part_shapes() == ([2], [max(map(len, sequences[:2]))]) and kv.mask.shape[1] == kv.part_shapes()[1][0]
    kv.keep([1, 0])
    kv.feed(torch.tensor([7, 8]))
    assert torch.allclose(kv.decode(), fresh_logits(tiny_model, [sequences[1] + [7], sequences[0] + [8]]), atol=1e-4)


def test_slot_kv_keep_across_parts_out_of_order_merges_them_first(tiny_model, prompt_ids):
    sequences = [list(prompt_ids[0]), (list(prompt_ids[2]) * 40)[:400]]
    kv = SlotKV.prefill(tiny_model, sequences[:1], pad_id=0, device=CPU).kv
    kv.extend(SlotKV.prefill(tiny_model, sequences[1:], pad_id=0, device=CPU).kv)
    assert kv.part_shapes()[0] == [1, 1]
    kv.keep([1, 0, 1])  # the rows' parts are visited out of order
    assert kv.part_shapes() == ([3], [400])
    kv.feed(torch.tensor([5, 6, 7]))
    expected = fresh_logits(tiny_model, [sequences[1] + [5], sequences[0] + [6], sequences[1] + [7]])
    assert torch.allclose(kv.decode(), expected, atol=1e-4)


@pytest.mark.parametrize("rows, lengths, plan", [
    ([4, 1], [100, 110], [0]),  # 4 x 10 padded cells: cheap
    ([32, 1], [300, 2000], []),  # 32 x 1700: a part of its own
    ([32, 1, 1], [300, 2000, 290], []),  # the short joiner cannot merge over the long row
    ([1] * 8, [1000 * i for i in range(1, 9)], [0, 1]),  # at most MAX_PARTS: the cheapest pairs merge
])
def test_merges_by_padding_added(rows, lengths, plan):
    assert merges(rows, lengths) == plan


def test_choose_kv_by_name_and_refuse_slots_that_cannot_fit(tiny_model, caplog):
    caplog.set_level("INFO")
    assert choose_kv(tiny_model, "dynamic", rows=4, columns=64) is DYNAMIC
    assert choose_kv(tiny_model, "slots", rows=4, columns=64) is SLOTS
    assert "KV cache: slots, grown as used up to" in caplog.text and "WARNING" not in caplog.text
    assert choose_kv(tiny_model, "slots", rows=10**7, columns=1000) is SLOTS  # a bound past memory
    assert "more than the" in caplog.text and "lower option.max_model_len" in caplog.text
    with pytest.raises(ValueError, match="one row of 1000000000000 tokens needs .* GiB .* lower option.max_model_len"):
        choose_kv(tiny_model, "slots", rows=1, columns=10**12)
    with pytest.raises(ValueError, match="unknown kv_cache 'paged'"):
        layout_for(tiny_model, "paged")


@pytest.mark.parametrize("kind", sorted(KV_LAYOUTS))
def test_kv_keep_indexes_each_layer_on_its_own_device(kind, tiny_model, prompt_ids, monkeypatch):
    """Under device_map=auto a model's layers live on several GPUs while the batch's mask lives on the
    first: `keep` must index each layer's K/V with an index on that layer's device (an index on
    cuda:0 fails on cuda:1). Here the mask stays on the CPU and the layers' K/V move to `meta`
    (standing in for another GPU), and every tensor index is checked against the tensor it indexes.
    Only the index placement is checked; a machine with two GPUs is what runs it on real memory."""
    layout = KV_LAYOUTS[kind]
    kv = layout.prefill(tiny_model, [list(prompt_ids[i]) for i in (0, 2)], pad_id=0, device=CPU).kv
    kv.extend(layout.prefill(tiny_model, [list(prompt_ids[i]) for i in (1, 4)], pad_id=0, device=CPU).kv)
    for layer in kv.cache.layers:
        if kind == "slots":
            for part in layer.parts:
                part.key_store, part.value_store = part.key_store.to("meta"), part.value_store.to("meta")
                part._refresh()
        else:
            layer.keys, layer.values = layer.keys.to("meta"), layer.values.to("meta")
    mismatched = []
    getitem = torch.Tensor.__getitem__

    def checked(self, index):
        for item in index if isinstance(index, tuple) else (index,):
            if isinstance(item, torch.Tensor) and item.dim() and item.device != self.device:
                mismatched.append((self.device, item.device))
        return getitem(self, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", checked)
    kv.keep([0, 2, 3])
    assert mismatched == []
    assert kv.mask.device == CPU and len(kv) == 3


@pytest.mark.parametrize("parts, survivors, order", [
    ([6], [0, 2, 3, 5], [0, 5, 2, 3]),  # row 1's place goes to the last survivor, 5; 4's place is gone
    ([6], [1, 2, 3, 4, 5], [5, 1, 2, 3, 4]),
    ([6], [0, 1, 2], [0, 1, 2]),  # the tail leaves: nothing moves
    ([3, 2], [1, 2, 3, 4], [2, 1, 3, 4]),  # each part fills its own places: parts stay runs of rows
    ([3, 2], [0, 4], [0, 4]),
])
def test_slot_kv_eviction_order_fills_each_parts_places_with_its_last_rows(parts, survivors, order, monkeypatch):
    monkeypatch.setattr(SlotKV, "part_shapes", lambda self: (parts, [10] * len(parts)))
    assert SlotKV.eviction_order(object.__new__(SlotKV), survivors) == order


def test_slot_kv_eviction_copies_only_the_rows_that_move(tiny_model, prompt_ids, monkeypatch, slot_buffers):
    """Rows leave as the scheduler evicts them (kv/protocol.py item 9): each leaving row costs one row's
    copy, the longest row leaving costs none (its columns are dropped by moving the part's start), and
    every row's logits stay those of a fresh prefill of its sequence, through writes that pass the
    buffers' end (compacted) and a joiner merging into the moved part."""
    monkeypatch.setattr(SlotKV, "merge_slack", 10**9)  # one part
    sequences = [list(prompt_ids[i % 5]) + [i] for i in range(6)]
    sequences[3] = (list(prompt_ids[2]) * 10)[:60]  # the longest
    kv = SlotKV.prefill(tiny_model, sequences, pad_id=0, device=CPU).kv
    [part] = kv.cache.layers[0].parts
    store = part.key_store
    copied = []
    select = slot_part.SlotPart.select

    def counted(self, rows, targets, sources, first, pairs=()):
        copied.append(0 if targets is None else len(targets))
        assert len(pairs) == copied[-1]  # the same moves as ints: each row copied once, straight to its place
        return select(self, rows, targets, sources, first, pairs)

    monkeypatch.setattr(slot_part.SlotPart, "select", counted)

    def step(n=1):
        for _ in range(n):
            logits = decode_fed(kv, sequences, [30 + len(s) % 50 for s in sequences])
        assert_fresh(tiny_model, sequences, logits)

    step()
    order = kv.eviction_order([0, 2, 3, 4])  # rows 1 and 5 leave
    assert order == [0, 4, 2, 3]
    kv.keep(order)
    sequences = [sequences[i] for i in order]
    layers = len(kv._layers())
    assert copied == [1] * layers and part.key_store is store  # one row copied per layer, in place
    step()
    copied.clear()
    order = kv.eviction_order([0, 1, 2])  # the longest (now the last row) leaves
    kv.keep(order)
    sequences = [sequences[i] for i in order]
    assert copied == [0] * layers and part.start > 0 and part.key_store is store
    step(slot_part.MIN_COLUMNS - part.end + 2)  # past the buffer's end: compacted, not grown
    assert part.start == 0 and part.key_store.shape[2] == store.shape[2]
    kv.extend(SlotKV.prefill(tiny_model, [list(prompt_ids[1])], pad_id=0, device=CPU).kv)
    sequences.append(list(prompt_ids[1]))
    step()


def test_slot_kv_a_join_writes_the_joiners_rows_only(tiny_model, prompt_ids, monkeypatch, slot_buffers):
    """A joiner merging into a part whose window starts past column 0 (the longest row left) leaves the
    rows here in place: a shorter joiner is written right-aligned in the window, a longer one takes
    columns left of it (zeroed for the rows here), so neither copies a row already there; a joiner longer
    than the room on the left moves the rows once. Every row's logits stay a fresh prefill's throughout."""
    monkeypatch.setattr(SlotKV, "merge_slack", 10**9)  # one part
    sequences = [list(prompt_ids[i % 5]) + [i] for i in range(6)]
    sequences[1] = (list(prompt_ids[2]) * 10)[:40]  # the longest
    kv = SlotKV.prefill(tiny_model, sequences, pad_id=0, device=CPU).kv
    [part] = kv.cache.layers[0].parts
    moved = []
    clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: moved.append(self.shape) or clone(self, *a, **k))

    def step():
        logits = decode_fed(kv, sequences, [40 + len(s) % 50 for s in sequences])
        assert_fresh(tiny_model, sequences, logits)

    step()
    order = kv.eviction_order([0, 2, 3])  # the longest and two more leave: the window's start moves right
    kv.keep(order)
    sequences = [sequences[i] for i in order]
    room = part.start
    assert room > 2 and part.length == max(len(s) for s in sequences)
    store = part.key_store
    assert store.shape[0] >= 6  # room for the three joiners' rows: no buffer is remade for rows

    def join(sequence):
        joiner = SlotKV.prefill(tiny_model, [sequence], pad_id=0, device=CPU).kv
        moved.clear()
        kv.extend(joiner)
        sequences.append(sequence)

    join(list(prompt_ids[0])[:3])  # shorter than the window
    assert part.start == room and part.key_store is store and moved == []  # written in place, nothing moved
    step()
    start = part.start
    join((list(prompt_ids[3]) * 10)[:part.length + 2])  # two columns wider than the window
    assert part.start == start - 2 and part.key_store is store and moved == []  # the window grew to the left
    step()
    join((list(prompt_ids[4]) * 20)[:part.length + part.start + 5])  # wider than the room on the left
    assert len(moved) == 2 * len(kv._layers())  # K and V moved once per layer
    step()
