"""kvpack.compress: argument checks, determinism, chunked prefill, KVzip's repeat prompts."""

from __future__ import annotations

import pytest
import torch

import kvpack
from kvpack import tasks
from kvpack.errors import InputError
from kvpack.fileformat import pack_to_bytes
from kvpack.layout import chat_layout
from kvpack.methods.base import select_global
from kvpack.model import model_spec
from kvpack.prefill import prefill

from .tiny import TEXT, tiny_model


@pytest.mark.parametrize("kwargs", [dict(ratio=0.0), dict(ratio=1.5), dict(ratio="0.3"), dict(chunk_size=0),
                                    dict(method="nope"), dict(tail_tokens="x", ratio=0.5),
                                    dict(stage_seconds=[])])
def test_bad_arguments_raise_input_error(kwargs):
    model, tok = tiny_model("llama")
    with pytest.raises(InputError):
        kvpack.compress(model, tok, TEXT, **kwargs)


def test_empty_text_is_refused():
    model, tok = tiny_model("llama")
    with pytest.raises(InputError, match="empty"):
        kvpack.compress(model, tok, "  \n")


def test_identical_inputs_give_identical_bytes():
    model, tok = tiny_model("qwen3")
    a = pack_to_bytes(kvpack.compress(model, tok, TEXT, ratio=0.3, chunk_size=40))
    b = pack_to_bytes(kvpack.compress(model, tok, TEXT, ratio=0.3, chunk_size=40))
    assert a == b


def test_chunked_prefill_equals_one_pass():
    model, tok = tiny_model("llama")
    layout = chat_layout(tok)
    ids = layout.prefix_ids(tok) + layout.encode(tok, TEXT)
    spec = model_spec(model)
    one = prefill(model, ids, 3, layout, spec, chunk_size=len(ids))
    chunked = prefill(model, ids, 3, layout, spec, chunk_size=17)
    for a, b in zip(one.keys + one.values, chunked.keys + chunked.values):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_select_global_keeps_the_top_entries_and_breaks_ties_by_index():
    scores = torch.tensor([[[0.1, 0.9, 0.5, 0.5]], [[0.5, 0.0, 0.2, 0.3]]])  # [layers=2, heads=1, tokens=4]
    keep = select_global(scores, 0.5)  # 4 of 8
    assert keep.tolist() == [[[False, True, True, True]], [[True, False, False, False]]]


def test_kvzip_repeat_prompts_follow_the_paper(monkeypatch):
    """First chunk: "Repeat the previous context exactly."; later chunks quote the previous chunk's last 8
    tokens; each repeat input ends with the chunk's own tokens."""
    model, tok = tiny_model("llama")
    seen = []
    body = model.base_model
    original = body.forward

    def spy(*args, **kwargs):
        if isinstance(kwargs.get("past_key_values"), kvpack.KvpackCache):
            seen.append(kwargs["input_ids"][0].tolist())
        return original(*args, **kwargs)

    monkeypatch.setattr(body, "forward", spy)
    kvpack.compress(model, tok, TEXT, ratio=0.5, chunk_size=30)
    layout = chat_layout(tok)
    ctx = layout.encode(tok, TEXT)
    assert len(seen) == -(-len(ctx) // 30)
    first = tok.decode(seen[0])
    assert first.startswith("\n\n" + tasks.REPEAT_PROMPT + "<|end|>\n<|assistant|>\n")
    assert seen[0][-30:] == ctx[:30]
    second = tok.decode(seen[1])
    assert second.startswith("\n\n" + tasks.repeat_from_prompt(tok.decode(ctx[22:30])))
    assert seen[1][-30:] == ctx[30:60]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_kvzip_repeat_pass_stops_after_the_last_compressed_layers_attention(arch):
    """The repeat pass runs every compressed layer's attention (scores match eager attention elsewhere:
    ``test_kvzip_plus``), then ends: the last compressed layer's MLP, later layers and the final norm never run,
    and the forward hook that ends it is removed afterwards."""
    from kvpack.methods.kvzip import KVzip

    model, tok = tiny_model(arch)
    spec = model_spec(model)
    layers = model.base_model.layers
    last = spec.compressed_layers[-1]
    calls = {}
    # the shared model may carry transformers' own hooks (output_attentions=True adds one for good): compare ids
    before = [set(layers[l].self_attn._forward_hooks) for l in range(len(layers))]
    hooks = [m.register_forward_hook(lambda *a, key=key: calls.__setitem__(key, calls.get(key, 0) + 1))
             for key, m in [("attn", layers[last].self_attn), ("mlp", layers[last].mlp),
                            ("norm", model.base_model.norm)] + [(f"after {l}", layers[l]) for l in
                                                                   range(last + 1, len(layers))]]
    layout = chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 512)
    calls.clear()
    chunks = -(-full.context_tokens // 30)
    KVzip(chunk_size=30).score(model, tok, full)
    assert calls == {"attn": chunks}
    for h in hooks:
        h.remove()
    assert [set(layers[l].self_attn._forward_hooks) for l in range(len(layers))] == before  # scoring left none


def test_stage_seconds_cover_the_build():
    """``stage_seconds`` times every stage once, and the stages add up to no more than the whole build."""
    import time

    model, tok = tiny_model("llama")
    stages: dict[str, float] = {}
    t0 = time.perf_counter()
    pack = kvpack.compress(model, tok, TEXT, method="d2o", ratio=0.3, chunk_size=32, stage_seconds=stages)
    total = time.perf_counter() - t0
    assert list(stages) == ["tokenize", "prefill", "score", "select", "gather_merge", "quantize"]
    assert all(s > 0 for s in stages.values()) and sum(stages.values()) <= total
    assert pack.metadata["stats"]["merge"]["merged"] > 0
    none: dict[str, float] = {}
    kvpack.compress(model, tok, TEXT, method="none", stage_seconds=none)  # nothing scored
    assert "score" not in none and set(none) == set(stages) - {"score"}
