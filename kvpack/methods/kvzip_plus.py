"""KVzip+ scoring: KVzip's repeat-pass attention weighted by how much each entry can change the residual stream.

KVzip (arXiv 2505.23416, §3.2, Eq. 2) scores entry ``i`` of KV head ``h`` by ``max_{g, t} p[h, g, t, i]``, the
attention probability it receives from query head ``g`` of the GQA group at repeat query ``t``. KVzip+ (as NVIDIA
kvpress implements it: ``kvpress/presses/kvzip_press.py``, ``KVzipPress(kvzip_plus_normalization=True)``,
``score_kvzip``) weights each probability by the size of what the entry adds to the output, relative to the
input of the attention block at that query::

    score[h, i] = max_{g, t} p[h, g, t, i] * ||W_o[h, g]^T v[h, i]|| / ||x_t||

``W_o[h, g]`` is the ``head_dim`` columns of the output projection ``o_proj`` that query head ``(h, g)`` feeds
(``[hidden, head_dim]``), ``v[h, i]`` the cached value, and ``x_t`` the hidden state the attention module receives
for query ``t`` (after the layer's input norm, as kvpress reads ``hidden_states`` in its attention hook; not the raw
residual stream). ``||W_o v||`` is computed from the Gram matrix ``W_o^T W_o`` (``[head_dim, head_dim]`` per query
head), so no ``[entries, hidden]`` tensor is formed.

The weights reach ``kvpack.attention`` through the cache layer's ``score_weights``: the entry weights are set
before the pass, the query weights by a forward pre-hook on each attention module (``plus_weights``).
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import UnsupportedModelError
from ..model import ModelSpec

__all__ = ["value_output_norms", "output_gram", "plus_weights"]



def value_output_norms(values: torch.Tensor, o_proj_weight: torch.Tensor, gram: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """``||W_o[h, g]^T v[h, i]||`` for every query head ``(h, g)`` and entry ``i``: ``[kv_heads, group, n]`` float32.

    Args:
        values: ``[kv_heads, n, head_dim]`` cached values.
        o_proj_weight: ``[hidden, heads x head_dim]``, the output projection's weight (``nn.Linear`` layout);
            query head ``j = h x group + g`` owns its columns ``j x head_dim .. (j + 1) x head_dim - 1``.
        gram: ``[kv_heads, group, head_dim, head_dim]`` float32 ``W_o[h, g]^T W_o[h, g]`` if already computed
            (``output_gram``).

    Source: kvpress ``KVzipPress.score_kvzip`` (its ``WoV_norm``), computed as ``sqrt(v^T (W_o^T W_o) v)``.
    """
    kv_heads, n, dim = values.shape
    if gram is None:
        gram = output_gram(o_proj_weight, kv_heads, dim)
    v = values.float()
    sq = torch.einsum("hnd,hgde,hne->hgn", v, gram, v)
    return sq.clamp_min_(0).sqrt_()


def output_gram(o_proj_weight: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``W_o[h, g]^T W_o[h, g]`` per query head: ``[kv_heads, group, head_dim, head_dim]`` float32 (see
    ``value_output_norms``). Raises ``UnsupportedModelError`` if the weight's width is not a whole number of heads."""
    hidden, width = o_proj_weight.shape
    if width % (kv_heads * head_dim):
        raise UnsupportedModelError(f"KVzip+: o_proj has {width} inputs, not a multiple of {kv_heads} KV heads x "
                                    f"{head_dim}")
    w = o_proj_weight.float().T.reshape(kv_heads, width // (kv_heads * head_dim), head_dim, hidden)
    return w @ w.transpose(-1, -2)


def _attention_modules(model, spec: ModelSpec) -> dict[int, torch.nn.Module]:
    """The attention module of each compressed layer (``model.base_model.layers[l].self_attn``)."""
    layers = getattr(model.base_model, "layers", None)
    out = {}
    for l in spec.compressed_layers:
        attn = getattr(layers[l], "self_attn", None) if layers is not None else None
        if attn is None or not hasattr(attn, "o_proj"):
            raise UnsupportedModelError(f"KVzip+ needs layer {l}'s self_attn.o_proj; {type(model).__name__} has none")
        out[l] = attn
    return out


@contextlib.contextmanager
def plus_weights(model, spec: ModelSpec, cache, grams: dict[int, torch.Tensor] | None = None):
    """Within this context, the repeat pass over ``cache`` (a ``KvpackCache`` whose compressed layers carry a
    ``scores`` buffer) scores by KVzip+ (module docstring).

    Sets each compressed layer's entry weights ``||W_o v||`` (``[kv_heads, group, kept]``, the layer's cached
    entries) and, through a forward pre-hook on its attention module, the query weights ``1 / ||x_t||``
    (``[q]``) of the hidden states it receives. ``grams``: per layer index, ``output_gram`` results to reuse
    across chunks (filled in when missing). Hooks and weights are removed on exit.
    """
    modules = _attention_modules(model, spec)
    grams = {} if grams is None else grams
    entry = {}
    for l, attn in modules.items():
        layer = cache.layers[l]
        if l not in grams:
            grams[l] = output_gram(attn.o_proj.weight, spec.num_kv_heads, spec.head_dim).to(layer.device)
        values = layer.padded()[1][0, :, : layer.kept]  # [kv_heads, kept, head_dim], padding rows zero
        entry[l] = value_output_norms(values, attn.o_proj.weight, grams[l])

    def hook(l):
        def pre(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)  # [1, q, hidden]
            norms = hidden[0].float().norm(dim=-1)
            cache.layers[l].score_weights = (entry[l], 1.0 / norms.clamp_min(torch.finfo(torch.float32).tiny))
        return pre

    handles = [attn.register_forward_pre_hook(hook(l), with_kwargs=True) for l, attn in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for l in modules:
            cache.layers[l].score_weights = None
