"""Decoder layers of the Llama family in fewer operations, the same bits (model surgery, no engine).

At one stream a SmolLM2 decode step spends ~4.5-6.5 ms of ~21 outside its Linear layers (benchmarks/journal/2026-11.md,
"Lean decoder layers"): per layer about a dozen module calls, a copy per stacked projection's member, seven
ops per rotary and transformers' keyword plumbing. A lean layer runs the same arithmetic in fewer calls (a
decode step 0.97-0.99x the time):

- the members of one stacked matmul (q/k/v, gate/up: shared_input.py) are views of its output, not copies;
- rotary as `x * cos + roll(x, half) * sin'`, where sin' is sin with its first half negated (made once per
  forward): the products and sums of transformers' `x * cos + rotate_half(x) * sin`, as IEEE products are
  symmetric in sign; q and k rotate in one call when they are adjacent columns of one output, a numba one
  where it applies (kernels/cpu/rotary_kernel.py: the same roundings, ~10 torch calls a layer fewer);
- a decode step on a cache that writes and attends in one call (`decode_attend`: engine/kv/slots.py, the slot
  cache) goes there instead of through transformers' `update` and attention interface: the same write and
  kernel, ~15 calls a layer fewer;
- the attention and MLP modules' forwards are inlined (the decoder layer itself stays a module call, so
  hooks on it, such as transformers' hidden-state capture, still fire);
- a few fp32 rows whose layers are all on our kernels (the row kernel's copies, the norm kernel) go through
  kernels/cpu/layer_chain.py: norms, matmuls, rotary and residual adds in three numba calls, the same bits; a few
  q4-bf16 rows on the Q4 kernel through kernels/cpu/q4_chain.py alike.

Every other layer (a LoRA wrapper, a sharded or quantized Linear) is called as the module it is. A layer is
made lean only where its classes are transformers' own ones written here for (LEAN_LAYERS; remote code that
reuses a class name keeps its forward); a forward it cannot take the
short way (partial rotary, an unexpected rotary width) runs transformers' own.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lmi_serve.kernels.cpu import rotary_kernel
from lmi_serve.kernels.layers.chains import LayerChain, Q4LayerChain
from lmi_serve.kernels.layers.shared_input import SharedInputSlice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeanSpec:
    """What a family's attention adds to Llama's: per-head norms of q and k before rotary (Qwen3), and a
    `sliding_window` argument to the attention function (Qwen2, Qwen3)."""

    qk_norms: bool = False
    sliding_window: bool = False


# Decoder layer class name -> its family's spec. Each was read against transformers' forward of that class;
# tests/unit/model/test_lean_layers.py holds every one to its own forward's bits.
LEAN_LAYERS = {
    "LlamaDecoderLayer": LeanSpec(),
    "Qwen2DecoderLayer": LeanSpec(sliding_window=True),
    "Qwen3DecoderLayer": LeanSpec(qk_norms=True, sliding_window=True),
}
_ATTENTION = {"LlamaDecoderLayer": "LlamaAttention", "Qwen2DecoderLayer": "Qwen2Attention",
              "Qwen3DecoderLayer": "Qwen3Attention"}
_MLP = {"LlamaDecoderLayer": "LlamaMLP", "Qwen2DecoderLayer": "Qwen2MLP", "Qwen3DecoderLayer": "Qwen3MLP"}
_MODULE = {"LlamaDecoderLayer": "transformers.models.llama.modeling_llama",
           "Qwen2DecoderLayer": "transformers.models.qwen2.modeling_qwen2",
           "Qwen3DecoderLayer": "transformers.models.qwen3.modeling_qwen3"}


def _is(module: Any, name: str, where: str) -> bool:
    """`module` is transformers' own class `name` of the module `where` (not remote code that reuses the name)."""
    return type(module).__name__ == name and type(module).__module__ == where


class SignedSin:
    """sin with the first half of its last dimension negated, for the rotary's `roll` form; made once per
    forward (every layer of one forward gets the same `cos` and `sin` tensors) and kept with them, as are
    both with a heads dimension (`terms`: two views a forward, not two a layer)."""

    def __init__(self) -> None:
        self._kept: tuple[Any, ...] | None = None  # (cos, sin, cos [b, 1, t, d], sin' [b, 1, t, d])

    def terms(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin' as [batch, 1, tokens, head_dim], for `rotate_heads`."""
        kept = self._kept  # one read: a tuple swapped whole, never half-written
        if kept is None or kept[0] is not cos or kept[1] is not sin:
            signed = sin.clone()
            signed[..., : sin.shape[-1] // 2].neg_()
            kept = (cos, sin, cos.unsqueeze(1), signed.unsqueeze(1))
            self._kept = kept
        return kept[2], kept[3]


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` for x [batch, heads, tokens, head_dim] and cos, sin' [batch, 1, tokens,
    head_dim] (SignedSin.terms), bit for bit: rotate_half(x) * sin is roll(x, half) * sin'."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def stacked(layers: tuple[nn.Module, ...]) -> bool:
    """Whether `layers` are the members of one stacked matmul, in order (their outputs adjacent columns)."""
    first = layers[0]
    if not isinstance(first, SharedInputSlice):
        return False
    group = first._group
    return group.members == len(layers) and all(
        isinstance(layer, SharedInputSlice) and layer._group is group and layer._member == i
        for i, layer in enumerate(layers))


def project(x: torch.Tensor, layers: tuple[nn.Module, ...], is_stacked: bool | None = None) -> tuple[torch.Tensor, ...]:
    """Each layer's output for `x`: where they are the members of one stacked matmul in order (`is_stacked`,
    when the caller knows), one call and views of its columns; else each layer called."""
    if is_stacked if is_stacked is not None else stacked(layers):
        out = layers[0]._group.linear(x)
        return tuple(out[..., layer._start:layer._stop] for layer in layers)
    return tuple(layer(x) for layer in layers)


class LeanLayer:
    """The lean forward of one decoder layer (its `forward`, set on the instance)."""

    def __init__(self, layer: nn.Module, spec: LeanSpec, signed_sin: SignedSin, eager: Any):
        self.layer, self.spec, self.signed_sin = layer, spec, signed_sin
        self.eager = eager  # the family's eager attention function, where the config asks for eager
        self.original = type(layer).forward.__get__(layer)  # transformers' own, for what this one does not take
        # (q, k, v) or (gate, up) modules -> whether they are one stacked matmul's members: asked once per set of
        # modules (a module swapped later, a LoRA wrapper, is another key)
        self._stacked: dict[tuple[nn.Module, ...], bool] = {}
        # the layer's children -> their chain (layer_chain.py) or None; made once per set, as _stacked
        self._chains: dict[tuple[nn.Module, ...], LayerChain | None] = {}  # Q4LayerChain is one too

    def __call__(self, hidden_states: torch.Tensor, attention_mask: Any = None, position_ids: Any = None,
                 past_key_values: Any = None, use_cache: bool | None = False,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
        layer = self.layer
        children = layer._modules  # dict reads, not nn.Module.__getattr__: ~20 a layer, 600 a step
        attn = children["self_attn"]
        if position_embeddings is None or position_embeddings[0].shape[-1] != attn.head_dim or layer.training:
            return self.original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
        mlp = children["mlp"]._modules
        # the chain's key only where a chain could take these rows: a few fp32 or bf16 rows
        few = LayerChain.few_rows(hidden_states) or Q4LayerChain.few_rows(hidden_states)
        chain = self._chain_of(children, attn._modules, mlp) if few else None
        if chain is not None and chain.takes(hidden_states):  # three numba calls (layer_chain.py, q4_chain.py)
            tables = (None, None) if self.spec.qk_norms else self.signed_sin.terms(*position_embeddings)
            qkv, rotated = chain.attention_in(hidden_states, *tables, attn.head_dim)  # q and k rotated too
            attended = self._attention(attn, qkv.split(chain.qkv_sizes, -1), True, attention_mask, position_ids,
                                       past_key_values, use_cache, position_embeddings, kwargs, rotated)
            hidden_states, gate_up = chain.attention_out(attended, hidden_states)
            gate, up = gate_up.split(chain.gate_up_sizes, -1)
            return chain.mlp_out(self._gated(mlp, children, gate, up), hidden_states)
        members = (attn._modules["q_proj"], attn._modules["k_proj"], attn._modules["v_proj"])
        one_matmul = self._is_stacked(members)
        projected = project(children["input_layernorm"](hidden_states), members, one_matmul)
        attended = self._attention(attn, projected, one_matmul, attention_mask, position_ids, past_key_values,
                                   use_cache, position_embeddings, kwargs)
        hidden_states = hidden_states + attn._modules["o_proj"](attended)
        members = (mlp["gate_proj"], mlp["up_proj"])
        gate, up = project(children["post_attention_layernorm"](hidden_states), members, self._is_stacked(members))
        return hidden_states + mlp["down_proj"](self._gated(mlp, children, gate, up))

    @staticmethod
    def _gated(mlp: dict, children: dict, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        act = mlp.get("act_fn") or children["mlp"].act_fn
        return (F.silu(gate) if type(act) in (SiLUActivation, nn.SiLU) else act(gate)).mul_(up)

    def _chain_of(self, children: dict, attn: dict, mlp: dict) -> LayerChain | None:
        """The layer's chain for its children as they are now (made once per set: a child swapped later, a
        LoRA wrapper, is another key, and may have none): fp32 on the row kernel, or q4-bf16 on the Q4 kernel."""
        key = (children["input_layernorm"], attn["q_proj"], attn["k_proj"], attn["v_proj"], attn["o_proj"],
               children["post_attention_layernorm"], mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"])
        chain = self._chains.get(key, False)
        if chain is False:
            pieces = (key[0], key[1:4], key[4], key[5], key[6:8], key[8])
            chain = self._chains[key] = LayerChain.of(*pieces) or Q4LayerChain.of(*pieces)
        return chain

    def _is_stacked(self, members: tuple[nn.Module, ...]) -> bool:
        known = self._stacked.get(members)
        if known is None:
            known = self._stacked[members] = stacked(members)
        return known

    def _attention(self, attn: nn.Module, projected: tuple[torch.Tensor, ...], one_matmul: bool, attention_mask: Any,
                   position_ids: Any, past_key_values: Any, use_cache: bool | None,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor], kwargs: dict,
                   rotated: torch.Tensor | None = None) -> torch.Tensor:
        """The attention's output before o_proj, [..., heads x head_dim], for q/k/v `projected` (`one_matmul`:
        views of one stacked output; `rotated`: q's and k's heads already rotated, layer_chain.py)."""
        children = attn._modules
        q, k, v = projected
        input_shape = q.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        cos, signed = self.signed_sin.terms(*position_embeddings)
        if rotated is not None:
            heads = q.shape[-1] // attn.head_dim
            q, k = rotated[:, :heads], rotated[:, heads:]
        elif self.spec.qk_norms:
            q = rotate_heads(children["q_norm"](q.view(hidden_shape)).transpose(1, 2), cos, signed)
            k = rotate_heads(children["k_norm"](k.view(hidden_shape)).transpose(1, 2), cos, signed)
        elif one_matmul or _adjacent(q, k):  # one stacked output's columns: rotate q and k in one call
            heads = q.shape[-1] // attn.head_dim
            joined = _joined(q, k)
            both = rotary_kernel.rotate(joined, joined.shape[-1] // attn.head_dim, attn.head_dim, cos, signed)
            if both is None:
                both = rotate_heads(joined.view(hidden_shape).transpose(1, 2), cos, signed)
            q, k = both[:, :heads], both[:, heads:]
        else:
            q = rotate_heads(q.view(hidden_shape).transpose(1, 2), cos, signed)
            k = rotate_heads(k.view(hidden_shape).transpose(1, 2), cos, signed)
        v = v.view(hidden_shape).transpose(1, 2)
        if past_key_values is not None:
            # a cache that writes and attends a decode step in one go (engine/kv/slots.py), the same bits
            fused = getattr(past_key_values, "decode_attend", None)
            out = None if fused is None else fused(attn, attn.layer_idx, q, k, v, attention_mask, attn.scaling, kwargs)
            if out is not None:
                return out.reshape(*input_shape, -1).contiguous()
            k, v = past_key_values.update(k, v, attn.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, self.eager)
        if self.spec.sliding_window:
            kwargs = {**kwargs, "sliding_window": attn.sliding_window}
        out, _ = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling,
                           position_ids=position_ids, use_cache=use_cache, **kwargs)
        return out.reshape(*input_shape, -1).contiguous()


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether k's columns follow q's in one buffer, rows strided alike (views of one stacked output)."""
    return (q.stride() == k.stride() and q.stride(-1) == 1 and q.dtype == k.dtype
            and k.data_ptr() == q.data_ptr() + q.shape[-1] * q.element_size()
            and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr())


def _joined(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The view over q's and k's columns together (they are adjacent: _adjacent)."""
    return q.as_strided((*q.shape[:-1], q.shape[-1] + k.shape[-1]), q.stride())


def _family(layer: nn.Module) -> LeanSpec | None:
    name = type(layer).__name__
    spec = LEAN_LAYERS.get(name)
    if spec is None or layer.training or type(layer).__module__ != _MODULE[name]:
        return None
    if not _is(getattr(layer, "self_attn", None), _ATTENTION[name], _MODULE[name]):
        return None
    if not _is(getattr(layer, "mlp", None), _MLP[name], _MODULE[name]):
        return None
    if layer.self_attn._forward_hooks or layer.self_attn._forward_pre_hooks or layer.mlp._forward_hooks \
            or layer.mlp._forward_pre_hooks:
        return None
    return spec


def use_lean_layers(model: nn.Module) -> list[str]:
    """Give every decoder layer of `model` that LEAN_LAYERS covers its lean forward, in place; returns
    their names (logged)."""
    signed_sin = SignedSin()
    made = []
    for name, module in model.named_modules():
        spec = _family(module)
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if spec is None or eager is None:
            continue
        module.forward = LeanLayer(module, spec, signed_sin, eager)
        made.append(name)
    if made:
        log.info("Lean decoder layers (fewer ops, the same bits): %d", len(made))
    return made
