"""The architecture matrix: tiny random-weight causal LMs of many families, built from transformers
configs here (no download), must come out of the engine exactly as transformers' own greedy
`model.generate()` makes them, token for token:

- alone, one request at a time;
- in one concurrent batch of prompts of different lengths (left padding; most prompts are longer
  than the windowed families' window);
- streamed (`Generation.start()` then `events()`), equal to the same batch read whole;
- while rows join and leave at different times (the scheduler driven step by step).

The windowed families (sliding window, local/global layers, attention chunks, KV sharing) use a
window of 8 tokens, so their prompts and generations cross it; a premise test checks that the window
really changes their output. Every family's weights are redrawn N(0, std) with a std that makes the
tiny model's greedy output depend on its prompt (another premise test), else equality would prove
nothing. `support.check_supported` lets all of these load; what it refuses is tested in
test_support.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers as tf

from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.encdec import decoder_prompt
from lmi_serve.engine.kv.mixed import MIXED_MODEL_TYPES
from lmi_serve.engine.kv.select import KV_LAYOUTS, layout_for
from lmi_serve.engine.kv.slots import SlotKV, SlotLayout
from lmi_serve.engine.speculation import NgramSettings, NgramSpeculation
from lmi_serve.engine.support import layer_types
from lmi_serve.engine.types import FinishReason, GenerationRequest, StopParams
from lmi_serve.kernels.layers.fused_norms import FusedRMSNorm, use_fused_norms
from lmi_serve.kernels.layers.lean_layers import LEAN_LAYERS, use_lean_layers
from lmi_serve.kernels.host import onednn_available
from lmi_serve.kernels.layers.linear_kernels import use_linear_kernel
from waiting import within

CPU = torch.device("cpu")
WINDOW = 8  # sliding window / attention chunk of the windowed families
NO_WINDOW = 1024  # the premise twin's window: longer than any sequence here
PROMPT_LENGTHS = (3, 13, 24, 6, 17)  # all differ; three are longer than WINDOW
NEW_TOKENS = 10


def _common(vocab: int, layers: int = 2, **extra) -> dict:
    return {**dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), **extra}


def _seq2seq_t5(vocab: int) -> dict:
    return dict(vocab_size=vocab, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, decoder_start_token_id=0,
                pad_token_id=0)


def _seq2seq_bart(vocab: int) -> dict:
    return dict(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128)


def forced_bos(model):
    """BART checkpoints force `<s>` as the first new token: the engine starts the decoder with it."""
    model.generation_config.forced_bos_token_id = 0
    return model


@dataclass(frozen=True)
class Family:
    build: Callable[[int, int], Any]  # (vocabulary size, window) -> model; unwindowed ones ignore the window
    std: float = 0.02  # the weights' redraw: tiny random models need larger ones to depend on their input
    window: str | None = None  # the window's kind in config.layer_types, for the windowed families


FAMILIES: dict[str, Family] = {
    # Learned absolute positions, read from our position ids.
    "gpt2": Family(lambda v, w: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=v, n_embd=32, n_layer=2, n_head=4, n_positions=128)), std=0.3),
    "opt": Family(lambda v, w: tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=v, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, word_embed_proj_dim=32)), std=0.3),
    # Rotary variants: partial rotary (NeoX, Phi), llama3 rope scaling, q/k norms (Qwen3).
    "gpt_neox": Family(lambda v, w: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128))),
    "llama_rope_scaling": Family(lambda v, w: tf.LlamaForCausalLM(tf.LlamaConfig(**_common(v), rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}))),
    "qwen2": Family(lambda v, w: tf.Qwen2ForCausalLM(tf.Qwen2Config(**_common(v)))),
    "qwen3": Family(lambda v, w: tf.Qwen3ForCausalLM(tf.Qwen3Config(**_common(v), head_dim=8))),
    "phi": Family(lambda v, w: tf.PhiForCausalLM(tf.PhiConfig(**_common(v)))),
    "falcon": Family(lambda v, w: tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=v, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)),
        std=0.3),
    # ALiBi: no position ids at all (support.ALIBI_MODEL_TYPES).
    "bloom": Family(lambda v, w: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=v, hidden_size=32, n_layer=2, n_head=4)),
                    std=0.3),
    # Windowed: every layer sliding (Mistral, Phi-3), alternating local/global (Gemma 2 and 3,
    # gpt-oss with attention sinks), chunked attention (Llama 4), KV shared across layers (Gemma 3n).
    "mistral": Family(lambda v, w: tf.MistralForCausalLM(tf.MistralConfig(**_common(v), sliding_window=w)),
                      window="sliding_attention"),
    "phi3": Family(lambda v, w: tf.Phi3ForCausalLM(tf.Phi3Config(**_common(v), sliding_window=w, pad_token_id=0)),
                   window="sliding_attention"),
    "gemma2": Family(lambda v, w: tf.Gemma2ForCausalLM(tf.Gemma2Config(**_common(v, 4), head_dim=8, sliding_window=w)),
                     window="sliding_attention"),
    "gemma3": Family(lambda v, w: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        **_common(v, 4), head_dim=8, sliding_window=w, sliding_window_pattern=2)), window="sliding_attention"),
    "gpt_oss": Family(lambda v, w: tf.GptOssForCausalLM(tf.GptOssConfig(
        **_common(v, 2), head_dim=8, sliding_window=w, num_local_experts=2, num_experts_per_tok=1)),
        window="sliding_attention"),
    "llama4_chunked": Family(lambda v, w: tf.Llama4ForCausalLM(tf.Llama4TextConfig(
        **_common(v, 4), head_dim=8, intermediate_size_mlp=64, num_local_experts=2, attention_chunk_size=w)),
        window="chunked_attention"),
    "gemma3n_kv_sharing": Family(lambda v, w: tf.Gemma3nForCausalLM(tf.Gemma3nTextConfig(
        **_common(v, 4, intermediate_size=[64] * 4), head_dim=8, sliding_window=w, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=v, laurel_rank=4, altup_num_inputs=2)),
        window="sliding_attention"),
    # Encoder-decoders (kv/encdec.py): the encoder once per row, right-padded; decoder rows left-padded
    # with relative positions (T5, mT5, UMT5) or absolute position embeddings read per row (the rest).
    "t5": Family(lambda v, w: tf.T5ForConditionalGeneration(tf.T5Config(**_seq2seq_t5(v))), std=0.5),
    "mt5": Family(lambda v, w: tf.MT5ForConditionalGeneration(tf.MT5Config(**_seq2seq_t5(v))), std=0.5),
    "umt5": Family(lambda v, w: tf.UMT5ForConditionalGeneration(tf.UMT5Config(**_seq2seq_t5(v))), std=0.5),
    "bart": Family(lambda v, w: forced_bos(tf.BartForConditionalGeneration(tf.BartConfig(**_seq2seq_bart(v)))),
                   std=0.2),
    "mbart": Family(lambda v, w: tf.MBartForConditionalGeneration(tf.MBartConfig(**_seq2seq_bart(v))), std=0.5),
    "marian": Family(lambda v, w: tf.MarianMTModel(tf.MarianConfig(**_seq2seq_bart(v), decoder_start_token_id=0, pad_token_id=0)),
                     std=0.2),
    "pegasus": Family(lambda v, w: tf.PegasusForConditionalGeneration(tf.PegasusConfig(**_seq2seq_bart(v))),
                      std=1.0),
}


def build(family: Family, vocab: int, window: int):
    torch.manual_seed(0)
    model = family.build(vocab, window)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:  # matrices and embeddings; norms keep their init
                parameter.normal_(0.0, family.std)
    model.to(torch.float32).eval()
    model.generation_config.eos_token_id = None  # every sequence runs its full length
    return model


def reference(model, prompt: tuple[int, ...], n: int = NEW_TOKENS) -> list[int]:
    """transformers' own greedy generation of exactly n tokens, for one unpadded prompt. An
    encoder-decoder's new tokens follow its decoder prompt, given here as the engine starts it
    (a forced first token is part of it); `forced_eos_token_id` would swap a length-capped
    sequence's last token for EOS, which the engine does not do (see kv/encdec.py)."""
    extra = {}
    start = prompt
    if model.config.is_encoder_decoder:
        start = decoder_prompt(model)
        extra = dict(decoder_input_ids=torch.tensor([start]), forced_eos_token_id=None)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **extra)
    return out[0, len(start):].tolist()


def greedy(prompt: tuple[int, ...], n: int = NEW_TOKENS) -> GenerationRequest:
    return GenerationRequest(prompt, stop=StopParams(max_new_tokens=n, eos_token_ids=frozenset(), ignore_eos=True))


# Families whose RMSNorm is Llama's formula, which F.rms_norm must take over (kernels/layers/fused_norms.py).
LLAMA_NORMS = frozenset({"llama_rope_scaling", "qwen2", "qwen3", "mistral", "phi3"})


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fused_norms_keep_every_familys_logits_bit_for_bit(name, smollm2_tokenizer):
    """RMSNorm layers go on F.rms_norm only where that answers their bits (a probe per class): every
    family's logits are unchanged, and the Llama-formula families are swapped (others may be too, as
    Gemma 3n's, whose norm without Gemma's `1 + weight` gives the same bits)."""
    model = build(FAMILIES[name], len(smollm2_tokenizer), WINDOW)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor):
                module.weight.normal_(1.0, 0.3)  # a weight that matters (the init is all ones, or zeros)
    ids = torch.randint(3, len(smollm2_tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))
    extra = {"decoder_input_ids": ids[:, :4]} if model.config.is_encoder_decoder else {}
    with torch.inference_mode():
        before = model(input_ids=ids, **extra).logits
        swapped = use_fused_norms(model)
        after = model(input_ids=ids, **extra).logits
    assert torch.equal(before, after)
    assert all(isinstance(model.get_submodule(n), FusedRMSNorm) for n in swapped)
    assert swapped or name not in LLAMA_NORMS


@dataclass
class Served:
    name: str
    family: Family
    model: Any
    prompts: list[tuple[int, ...]]
    expected: list[list[int]]  # reference() of each prompt
    engine: Engine
    kv_layout: Any = None  # the KV layout under test (None: the model's default)
    weights: dict | None = None  # the model's state dict as built (before a Linear kernel swap)
    onednn: bool = False  # its Linear layers run on oneDNN


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small gain nothing from intra-op threads, and on a busy 2-core machine their
    synchronisation made every forward ~30x slower; results do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SEQ2SEQ = frozenset({"t5", "mt5", "umt5", "bart", "mbart", "marian", "pegasus"})
# Decoder-only families run on each decoder-only KV implementation (option.kv_cache); encoder-decoders
# have their own (kv/encdec.py).
class EveryLengthItsPart(SlotKV):
    """The slot cache with rows of different lengths never merged into one part (kv/slots.py): every
    family also runs with its rows attending per part (kv/slot_attention.py), where the model allows it."""

    merge_slack = 0


KV_UNDER_TEST = {**KV_LAYOUTS, "slots-parts": SlotLayout(EveryLengthItsPart)}
# Every family also runs with its fp32 Linear layers on oneDNN (option.linear_kernel, kernels/layers/linear_kernels.py)
# on its default KV cache: the references are then generate()'s on the swapped model, before the families
# that have them get their lean decoder layers (kernels/layers/lean_layers.py), as the server runs them.
ONEDNN = "onednn"
CASES = [(name, kv) for name in FAMILIES for kv in ((None,) if name in SEQ2SEQ else sorted(KV_UNDER_TEST))]
CASES += [(name, ONEDNN) for name in FAMILIES] if onednn_available() else []


@pytest.fixture(scope="module", params=CASES, ids=[f"{name}-{kv or 'encdec'}" for name, kv in CASES])
def served(request, smollm2_tokenizer):
    """One family on one KV implementation: its model (built once), prompts, transformers'
    references and a running engine."""
    name, kv = request.param
    family = FAMILIES[name]
    vocab = len(smollm2_tokenizer)
    model = build(family, vocab, WINDOW)
    weights = model.state_dict()
    if kv == ONEDNN:
        assert use_linear_kernel(model, "onednn", CPU, lean=False).swapped
    generator = torch.Generator().manual_seed(1)
    first = len(smollm2_tokenizer.all_special_ids) + 1  # plain tokens: the detokenizer shows them all
    prompts = [tuple(torch.randint(first, vocab, (n,), generator=generator).tolist()) for n in PROMPT_LENGTHS]
    expected = [reference(model, p) for p in prompts]
    if kv == ONEDNN:  # after the references: the engine's lean layers are held to transformers' own forward
        lean_kind = {type(m).__name__ for m in model.modules()} & set(LEAN_LAYERS)
        assert bool(use_lean_layers(model)) == bool(lean_kind), f"{name}: lean layers where {lean_kind}"
    layout = KV_UNDER_TEST[kv] if kv in KV_UNDER_TEST else None
    engine = Engine(model, smollm2_tokenizer, CPU, max_batch_size=8, name=name, kv_layout=layout).start()
    yield Served(name, family, model, prompts, expected, engine, layout, weights, kv == ONEDNN)
    engine.stop()


def token_ids(result) -> list[int]:
    assert result.error is None, result.error
    assert result.finish_reason is FinishReason.LENGTH
    return [event.token_id for event in result.events]


# -- premises: the equalities below would prove nothing without them ----------------------------

def test_premise_greedy_output_depends_on_the_prompt(served):
    assert len({tuple(e) for e in served.expected}) == len(served.expected), "two prompts, one output"
    assert max(len(set(e)) for e in served.expected) >= 4, f"degenerate output: {served.expected}"


def test_premise_the_window_changes_the_output(served, smollm2_tokenizer):
    kinds = set(layer_types(served.model.config.get_text_config(decoder=True)))
    if served.family.window is None:
        assert kinds == {"full_attention"}
        return
    assert served.family.window in kinds
    twin = build(served.family, len(smollm2_tokenizer), NO_WINDOW)
    twin.load_state_dict(served.weights)
    if served.onednn:
        use_linear_kernel(twin, "onednn", CPU)
    long_prompts = [(p, e) for p, e in zip(served.prompts, served.expected) if len(p) > WINDOW]
    assert any(reference(twin, p) != e for p, e in long_prompts), "the window never mattered"


# -- the engine equals transformers ----------------------------------------------------------------

def test_alone_equals_generate(served):
    for prompt, expected in zip(served.prompts, served.expected):
        [result] = within(lambda p=prompt: served.engine.generate([greedy(p)]).results())
        assert token_ids(result) == expected, f"{served.name}, prompt of {len(prompt)} tokens"


def test_mixed_length_batch_equals_generate(served):
    results = within(lambda: served.engine.generate([greedy(p) for p in served.prompts]).results())
    for prompt, result, expected in zip(served.prompts, results, served.expected):
        assert token_ids(result) == expected, f"{served.name}, prompt of {len(prompt)} tokens"


def test_streamed_equals_non_streamed(served):
    requests = [greedy(p) for p in served.prompts]
    whole = within(lambda: served.engine.generate(requests).results())

    def stream():
        generation = served.engine.generate(requests)
        generation.start()
        return list(generation.events())

    streamed: list[list] = [[] for _ in requests]
    for index, event in within(stream):
        streamed[index].append(event)
    for events, result, expected in zip(streamed, whole, served.expected):
        assert [e.token_id for e in events] == token_ids(result) == expected
        assert "".join(e.text for e in events) == result.text
        assert events[-1].finish_reason is FinishReason.LENGTH


def test_verify_and_discard_give_each_positions_logits(served):
    """n-gram speculation's KV verbs (kv/protocol.py item 10) in every family: a forward over the pending
    token and three drafts gives each position the logits of a plain forward over the sequence so far
    (positions, masks and the windowed families' windows included), and after two drafts are discarded
    the row decodes as if they had never been fed."""
    layout = served.kv_layout or layout_for(served.model)
    if served.model.config.is_encoder_decoder:
        assert not layout.supports_speculation  # its KV cache cannot take drafts back
        return
    prompt = served.prompts[2]  # longer than the window
    drafts = [7, 8, 9]

    def plain(sequence) -> torch.Tensor:
        with torch.inference_mode():
            return served.model(input_ids=torch.tensor([sequence])).logits[0].float()

    with torch.inference_mode():
        kv = layout.prefill(served.model, [prompt], pad_id=0, device=CPU).kv
        kv.feed(torch.tensor([5]))
        verified = kv.verify(drafts).float()
    sequence = [*prompt, 5, *drafts]
    expected = plain(sequence)[len(prompt):]
    assert torch.allclose(verified, expected, atol=1e-4), f"{served.name}: {(verified - expected).abs().max()}"
    kv.discard(2)
    kv.feed(torch.tensor([11]))
    with torch.inference_mode():
        decoded = kv.decode()[0].float()
    assert torch.allclose(decoded, plain([*prompt, 5, 7, 11])[-1], atol=1e-4), served.name


def test_ngram_speculation_equals_generate(served, smollm2_tokenizer):
    """A prompt that repeats itself (its generation, then the prompt again): prompt lookup proposes what
    followed the prompt the first time (where the family continues the repeat as it did the prompt: not
    the families with absolute position embeddings), and the output stays transformers' own."""
    if served.model.config.is_encoder_decoder:
        with pytest.raises(ValueError, match="cannot verify draft tokens"):
            Engine(served.model, smollm2_tokenizer, CPU, speculation=NgramSpeculation(NgramSettings()))
        return
    engine = Engine(served.model, smollm2_tokenizer, CPU, max_batch_size=8, name=f"{served.name}-ngram",
                    kv_layout=served.kv_layout, speculation=NgramSpeculation(NgramSettings(length=4))).start()
    try:
        for prompt, first in list(zip(served.prompts, served.expected))[1:3]:
            repeated = (*prompt, *first, *prompt)
            [result] = within(lambda: engine.generate([greedy(repeated)]).results())
            assert token_ids(result) == reference(served.model, repeated), f"{served.name}, {len(repeated)} tokens"
    finally:
        engine.stop()


def test_rows_join_and_leave_at_different_times(served, smollm2_tokenizer):
    """The scheduler stepped by hand: generations join a running batch and rows end at different
    steps, so the cache is extended (left-padding the shorter side) and trimmed while others run."""
    engine = Engine(served.model, smollm2_tokenizer, CPU, max_batch_size=8, name=f"{served.name}-steps",
                    kv_layout=served.kv_layout)
    scheduler = engine.scheduler
    p = served.prompts

    def run(steps: int) -> None:
        for _ in range(steps):
            if not scheduler.waiting and not scheduler.batch:
                return
            scheduler.step()

    plan = []  # (generation, [(prompt index, new tokens)])

    def submit(*rows: tuple[int, int]) -> None:
        plan.append((engine.generate([greedy(p[i], n) for i, n in rows]), rows))

    submit((0, 10), (2, 3))  # the short prompt and the longest; the longest leaves after 3 tokens
    run(2)
    submit((1, 6), (3, 9))  # joins a running batch
    run(3)
    submit((4, 4))  # joins after the first row left
    run(100)
    assert not scheduler.waiting and not scheduler.batch
    for generation, rows in plan:
        for (i, n), result in zip(rows, within(generation.results)):
            assert token_ids(result) == served.expected[i][:n], f"{served.name}, prompt {i} ({n} tokens)"
    assert scheduler.stats.admitted == 5 and scheduler.stats.largest_batch >= 3  # they did run together
    # Joiners rode in the running rows' forward where the family mixes (kv/mixed.py), and only there.
    assert (scheduler.stats.mixed_steps > 0) is scheduler.mixed
    assert scheduler.mixed is (served.model.config.model_type in MIXED_MODEL_TYPES and not served.family.window
                               and not served.model.config.is_encoder_decoder)


def test_every_model_type_that_mixes_is_in_the_matrix(smollm2_tokenizer):
    """kv/mixed.py packs only the model types this matrix holds to generate()."""
    checked = {build(family, 64, WINDOW).config.model_type for family in FAMILIES.values() if not family.window}
    assert MIXED_MODEL_TYPES <= checked
