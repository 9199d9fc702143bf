"""tools/make_shape_model.py: random-weight stand-ins with real models' layer shapes (issue 16)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import kvpack
from kvpack.cli import cli
from kvpack.model import model_spec

from .tiny import TEXT

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("make_shape_model", ROOT / "tools" / "make_shape_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


msm = _tool()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.mark.parametrize("name", sorted(msm.SHAPES))
def test_shapes_give_the_published_parameter_count(name):
    """With the real vocabulary, the shapes add up to the model's published parameter count exactly: a wrong
    hidden size, head count, head_dim, intermediate size, bias or tying would change it."""
    shapes = msm.parameter_shapes(msm.shape_config(name, vocab="real"))
    assert sum(math.prod(s) for s, _ in shapes.values()) == msm.SHAPES[name]["params"]


def test_architecture_details():
    gemma = msm.shape_config("gemma-3-1b")
    assert [i for i, t in enumerate(gemma.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    assert gemma.sliding_window == 512 and gemma.head_dim == 256 and gemma.query_pre_attn_scalar == 256
    assert gemma.rope_parameters["sliding_attention"]["rope_theta"] == 10000
    assert gemma.rope_parameters["full_attention"]["rope_theta"] == 1000000
    names = msm.parameter_shapes(gemma)
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" not in names  # tied
    llama8 = msm.shape_config("llama-3.1-8b")
    assert llama8.rope_parameters["rope_type"] == "llama3" and llama8.rope_parameters["factor"] == 8.0
    assert "lm_head.weight" in msm.parameter_shapes(llama8)  # untied
    qwen = msm.parameter_shapes(msm.shape_config("qwen2.5-0.5b"))
    assert qwen["model.layers.0.self_attn.k_proj.bias"] == (torch.Size([128]), "bias")
    assert qwen["model.embed_tokens.weight"][0] == torch.Size([4096, 896])  # the reference vocabulary
    assert len(msm.shape_config("qwen2.5-7b", layers=3).layer_types) == 3


def test_bad_arguments_are_input_errors(tmp_path):
    with pytest.raises(kvpack.KvpackError, match="--layers must be 1..24"):
        msm.shape_config("qwen2.5-0.5b", layers=25)
    with pytest.raises(kvpack.KvpackError, match="unknown shape"):
        msm.shape_config("gpt-5")
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(kvpack.KvpackError, match="not empty"):
        msm.make_shape_model("qwen2.5-0.5b", tmp_path, layers=1)
    assert msm.main(["qwen2.5-0.5b", "--out", str(tmp_path), "--layers", "1"]) == 2
    assert (tmp_path / "x").read_text() == "keep me"


@pytest.fixture(scope="module")
def qwen_2l(tmp_path_factory):
    """The Qwen2.5-0.5B shape, 2 layers, float32, written in shards of at most 40 MiB."""
    out = tmp_path_factory.mktemp("shape") / "qwen2.5-0.5b-2l"
    return msm.make_shape_model("qwen2.5-0.5b", out, layers=2, seed=7, shard_mib=40)


def test_weights_sharded_deterministic_and_scaled(qwen_2l, tmp_path):
    index = json.loads((qwen_2l / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in qwen_2l.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    full = _tensors(qwen_2l)
    assert set(full) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in full.values())
    q = full["model.layers.1.self_attn.q_proj.weight"]
    assert q.shape == (896, 896) and abs(q.std().item() - 0.02) < 5e-4 and abs(q.mean().item()) < 5e-4
    assert torch.equal(full["model.layers.0.input_layernorm.weight"], torch.ones(896))
    assert torch.equal(full["model.layers.0.self_attn.q_proj.bias"], torch.zeros(896))
    # one layer with the same seed: the same first layer (each tensor's generator depends on its name only)
    one = _tensors(msm.make_shape_model("qwen2.5-0.5b", tmp_path / "one", layers=1, seed=7, dtype="bfloat16"))
    assert set(one) < set(full)
    for name, t in one.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, full[name].to(torch.bfloat16)), name
    other = _tensors(msm.make_shape_model("qwen2.5-0.5b", tmp_path / "seed8", layers=1, seed=8))
    assert not torch.equal(other["model.layers.0.mlp.up_proj.weight"], full["model.layers.0.mlp.up_proj.weight"])


def test_loads_and_builds_with_the_cli(qwen_2l, tmp_path):
    model, tok = kvpack.load_model(qwen_2l, device="cpu")
    assert model_spec(model) == kvpack.model.ModelSpec(2, 14, 2, 64, (), None)
    assert len(tok) == model.config.vocab_size == 4096
    # the reference tokenizer exactly (transformers would swap in Qwen2Tokenizer's own pre-tokenizer for qwen2)
    ref_tok = kvpack.load_model(device="cpu")[1]
    text = (ROOT / "kvpack" / "data" / "haystack").glob("*.txt")
    text = next(iter(sorted(text))).read_text(encoding="utf-8")[:20000]
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == ref_tok.apply_chat_template(
        chat, add_generation_prompt=True)
    assert abs(model.model.layers[1].mlp.down_proj.weight.std().item() - 0.02) < 5e-4
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT, encoding="utf-8")
    result = CliRunner().invoke(cli, ["build", str(doc), "--model", str(qwen_2l), "--device", "cpu",
                                      "--chunk-size", "64", "--out", str(tmp_path / "packs")])
    assert result.exit_code == 0, result.output
    cache = kvpack.load(tmp_path / "packs" / "doc.kvpack", model)
    keys = cache.layers[0].keys
    assert keys.shape[1] == 2 and keys.shape[-1] == 64  # [batch, kv_heads, tokens, head_dim]
    n_ctx = len(tok(TEXT)["input_ids"])
    assert keys.shape[2] < n_ctx  # KVzip at keep 0.3 evicted entries


def test_gemma_norms_are_identity(tmp_path):
    out = msm.make_shape_model("gemma-3-1b", tmp_path / "g", layers=1, dtype="bfloat16")
    t = _tensors(out)
    assert torch.equal(t["model.layers.0.self_attn.k_norm.weight"], torch.zeros(256, dtype=torch.bfloat16))
    model, _ = kvpack.load_model(out, device="cpu")
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.layer_types == ["sliding_attention"]
