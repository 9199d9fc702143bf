"""KVzip's head-level mode: head scores (max of entry scores, max over contexts), the safetensors file and its
checks, whole heads kept or dropped by ratio, the window, the model check, the CLI."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import kvpack
from kvpack.cli import cli
from kvpack.errors import InputError, ModelMismatchError
from kvpack.heads import HeadScores, load_head_scores, save_head_scores, top_heads
from kvpack.layout import chat_layout
from kvpack.methods.kvzip import KVzip
from kvpack.model import model_spec
from kvpack.prefill import prefill

from .servers import clean_memory  # noqa: F401 (fixture)
from .tiny import HEAD_TEXTS, TEXT, tiny_heads_file, tiny_model


def test_head_scores_are_the_max_entry_score_maximised_over_contexts():
    model, tok = tiny_model("qwen3")
    hs = kvpack.head_scores(model, tok, list(HEAD_TEXTS), names=["bees", "train"], chunk_size=32)
    spec, layout = model_spec(model), chat_layout(tok)
    per = []
    for text in HEAD_TEXTS:  # by hand: KVzip's entry scores of each context, max over the context's entries
        ids = layout.prefix_ids(tok) + layout.encode(tok, text)
        full = prefill(model, ids, len(layout.prefix_ids(tok)), layout, spec, 32)
        entry = KVzip(chunk_size=32).score(model, tok, full)
        per.append(torch.stack([torch.tensor([float(entry[l, h].max()) for h in range(entry.shape[1])])
                                for l in range(entry.shape[0])]))
    torch.testing.assert_close(hs.context_scores, torch.stack(per), rtol=0, atol=0)
    torch.testing.assert_close(hs.scores, torch.maximum(per[0], per[1]), rtol=0, atol=0)
    assert [c["name"] for c in hs.contexts] == ["bees", "train"]
    assert hs.contexts[0]["sha256"] == "%s" % __import__("hashlib").sha256(HEAD_TEXTS[0].encode()).hexdigest()
    assert hs.compressed_layers == list(spec.compressed_layers) and hs.method["scoring"] == "attention"


def test_top_heads_by_ratio_with_ties_to_the_lower_index():
    s = torch.tensor([[0.1, 0.9], [0.5, 0.5], [0.7, 0.2]])
    assert top_heads(s, 0.5).tolist() == [[False, True], [True, False], [True, False]]  # 0.9, 0.7, first 0.5
    assert top_heads(s, 0.0).sum() == 0 and top_heads(s, 1.0).all()
    assert int(top_heads(s, 0.6).sum()) == round(0.6 * 6)


def _file_with_scores(tmp_path, arch: str, scores: torch.Tensor) -> str:
    """A head-score file of tiny_model(arch) whose scores are ``scores``, others as kvpack heads writes them."""
    made = load_head_scores(tiny_heads_file(arch))
    path = tmp_path / f"hand-{arch}.safetensors"
    save_head_scores(HeadScores(scores, scores[None], made.compressed_layers, made.fingerprint, made.contexts[:1],
                                made.method), path)
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_whole_heads_are_kept_or_dropped_exactly_by_ratio(arch, ratio, tmp_path):
    model, tok = tiny_model(arch)
    spec = model_spec(model)
    layers, heads = len(spec.compressed_layers), spec.num_kv_heads
    scores = torch.arange(layers * heads, dtype=torch.float32).flip(0).reshape(layers, heads) / 10  # hand-built
    path = _file_with_scores(tmp_path, arch, scores)
    pack = kvpack.compress(model, tok, TEXT, method="kvzip-head", heads=path, ratio=ratio)
    n, sink = pack.original_tokens - pack.sink_tokens, pack.sink_tokens
    want = top_heads(scores, ratio)  # the highest scores: the first round(ratio x pairs) flat indices here
    assert int(want.sum()) == round(ratio * layers * heads)
    for i, l in enumerate(spec.compressed_layers):
        lengths = pack.layers[l].head_lengths - sink
        assert lengths.tolist() == [n if k else 0 for k in want[i].tolist()]
    for l in spec.sliding_layers:  # sliding-window layers are kept intact
        assert pack.layers[l].num_entries == pack.layers[l].head_lengths.sum()
    stats = pack.metadata["stats"]
    assert stats["context_entries_kept"] == int(want.sum()) * n and pack.metadata["ratio"] == ratio
    kvpack.save(pack, tmp_path / "p.kvpack")
    cache = kvpack.load(tmp_path / "p.kvpack", model, tokenizer=tok)
    assert isinstance(kvpack.generate(model, tok, cache, "Who?", max_new_tokens=2), str)


def test_window_keeps_the_last_tokens_of_dropped_heads(tmp_path):
    model, tok = tiny_model("llama")
    spec = model_spec(model)
    scores = torch.tensor([[0.2, 0.9], [0.8, 0.1]])
    path = _file_with_scores(tmp_path, "llama", scores)
    pack = kvpack.compress(model, tok, TEXT, method="kvzip-head", heads=path, ratio=0.5, window=7)
    sink, total = pack.sink_tokens, pack.original_tokens
    for i, l in enumerate(spec.compressed_layers):
        for h in range(spec.num_kv_heads):
            pos = pack.layers[l].head(h)[2].tolist()
            if (i, h) in ((0, 1), (1, 0)):
                assert pos == list(range(total))
            else:
                assert pos == list(range(sink)) + list(range(total - 7, total))
    assert pack.metadata["method_params"]["window"] == 7


def test_the_file_is_refused_for_another_model_naming_both():
    model, tok = tiny_model("llama")
    with pytest.raises(ModelMismatchError) as err:
        kvpack.compress(model, tok, TEXT, method="kvzip-head", heads=tiny_heads_file("qwen2"), ratio=0.5)
    msg = str(err.value)
    assert "tiny-qwen2" in msg and "tiny-llama" in msg and "kvpack heads" in msg


def test_without_heads_the_error_says_how_to_make_the_file():
    model, tok = tiny_model("llama")
    with pytest.raises(InputError, match=r"kvpack heads .*--out heads.safetensors.*--heads"):
        kvpack.compress(model, tok, TEXT, method="kvzip-head", ratio=0.5)


def test_save_load_round_trip_and_the_file_is_safetensors(tmp_path):
    hs = load_head_scores(tiny_heads_file("llama"))
    path = tmp_path / "h.safetensors"
    save_head_scores(hs, path)
    again = load_head_scores(path)
    assert torch.equal(again.scores, hs.scores) and torch.equal(again.context_scores, hs.context_scores)
    assert again.fingerprint == hs.fingerprint and again.contexts == hs.contexts
    header_len = int.from_bytes(path.read_bytes()[:8], "little")  # safetensors: u64 header size, JSON header
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    assert set(header) == {"__metadata__", "scores", "context_scores"}
    assert header["__metadata__"]["format"] == "kvpack-head-scores"
    assert [c["sha256"] for c in json.loads(header["__metadata__"]["contexts"])] == [
        __import__("hashlib").sha256(t.encode()).hexdigest() for t in HEAD_TEXTS]


def test_head_files_on_a_url_round_trip_and_a_stray_tensor_is_refused(clean_memory):
    hs = load_head_scores(tiny_heads_file("llama"))
    written = save_head_scores(hs, "memory://heads/h.safetensors")
    assert written == clean_memory.size("/heads/h.safetensors") > 0
    assert clean_memory.ls("/heads", detail=False) == ["/heads/h.safetensors"]  # no temporary left behind
    again = load_head_scores("memory://heads/h.safetensors")
    assert torch.equal(again.scores, hs.scores) and again.fingerprint == hs.fingerprint
    with pytest.raises(InputError, match="does not exist"):
        load_head_scores("memory://heads/missing.safetensors")
    from safetensors.torch import save

    data = save({"scores": hs.scores, "context_scores": hs.context_scores, "extra": torch.zeros(1)},
                metadata=__import__("safetensors").safe_open(tiny_heads_file("llama"), framework="pt").metadata())
    clean_memory.pipe("/heads/stray.safetensors", data)
    with pytest.raises(InputError, match="extra"):
        load_head_scores("memory://heads/stray.safetensors")


def _hostile(tmp_path, name: str, tensors: dict | None = None, **meta_changes) -> str:
    """A copy of the tiny llama head file with tensors or metadata fields replaced (``None`` removes a field)."""
    from safetensors import safe_open

    with safe_open(tiny_heads_file("llama"), framework="pt") as f:
        meta = dict(f.metadata())
        base = {k: f.get_tensor(k) for k in f.keys()}
    for k, v in meta_changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    path = tmp_path / f"{name}.safetensors"
    save_file(base if tensors is None else tensors, str(path), metadata=meta)
    return str(path)


@pytest.mark.parametrize("case, fragment", [
    ("garbage", "not a valid safetensors file"),
    ("pickle", "not a valid safetensors file"),
    ("format", "not a kvpack head-score file"),
    ("version", "has version '9'"),
    ("no_fingerprint", "metadata field 'fingerprint' is missing"),
    ("bad_json", "metadata field 'contexts' is not JSON"),
    ("shape", "tensor scores must be float32 of shape"),
    ("dtype", "tensor scores must be float32"),
    ("nan", "negative or non-finite"),
    ("extra", "exactly the tensors"),
    ("not_max", "not the maximum of context_scores"),
    ("layers", "compressed_layers must be increasing"),
    ("missing", "does not exist"),
])
def test_hostile_head_files_raise_input_error(tmp_path, case, fragment):
    good = load_head_scores(tiny_heads_file("llama"))
    s, per = good.scores, good.context_scores
    if case == "garbage":
        path = tmp_path / "g.safetensors"
        path.write_bytes(b"\xff" * 64)
    elif case == "pickle":
        path = tmp_path / "p.safetensors"
        torch.save({"scores": s}, path)
    elif case == "missing":
        path = tmp_path / "none.safetensors"
    else:
        tensors = {"scores": s, "context_scores": per}
        meta = {}
        if case == "format":
            meta["format"] = "gguf"
        elif case == "version":
            meta["version"] = "9"
        elif case == "no_fingerprint":
            meta["fingerprint"] = None
        elif case == "bad_json":
            meta["contexts"] = "[{"
        elif case == "layers":
            meta["compressed_layers"] = "[1, 0, 2, 3]"
        elif case == "shape":
            tensors = {"scores": s[:1].clone(), "context_scores": per[:, :1].clone()}
        elif case == "dtype":
            tensors = {"scores": s.double(), "context_scores": per}
        elif case == "nan":
            bad = s.clone()
            bad[0, 0] = float("nan")
            tensors = {"scores": bad, "context_scores": per}
        elif case == "extra":
            tensors = {**tensors, "payload": torch.zeros(3)}
        elif case == "not_max":
            tensors = {"scores": s + 1, "context_scores": per}
        path = _hostile(tmp_path, case, tensors, **meta)
    with pytest.raises(InputError, match=re.escape(fragment)):
        load_head_scores(path)


def test_cli_heads_build_and_info(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, t in enumerate(HEAD_TEXTS):
        (docs / f"h{i}.txt").write_text(t, encoding="utf-8")
    (tmp_path / "doc.txt").write_text(TEXT, encoding="utf-8")
    runner = CliRunner()
    heads = tmp_path / "new" / "folder" / "heads.safetensors"  # --out's folders are made, as build's are
    res = runner.invoke(cli, ["heads", str(docs), "--out", str(heads), "--chunk-size", "64", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    hs = load_head_scores(heads)
    assert [c["name"] for c in hs.contexts] == ["h0", "h1"] and hs.scores.shape == (4, 2)  # the reference model
    res = runner.invoke(cli, ["build", str(tmp_path / "doc.txt"), "--method", "kvzip-head", "--heads", str(heads),
                              "--ratio", "0.5", "--out", str(tmp_path / "packs"), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    info = runner.invoke(cli, ["info", str(tmp_path / "packs" / "doc.kvpack")]).output
    kept = top_heads(hs.scores, 0.5)
    assert re.search(r"^heads kept\s+4 of 8 \(layer, KV head\) pairs", info, re.M), info
    for l in range(4):
        listed = ", ".join(str(h) for h in range(2) if kept[l, h]) or "none"
        assert re.search(rf"^  layer {l}\s+{re.escape(listed)}$", info, re.M), info
    assert "context: " in info and "(50.0%)" in info
    res = runner.invoke(cli, ["build", str(tmp_path / "doc.txt"), "--method", "kvzip-head",
                              "--out", str(tmp_path / "p2"), "--device", "cpu"])
    assert res.exit_code == 1 and "error: kvzip-head needs head scores: make them once per model with " \
                                  "`kvpack heads" in res.output


def test_the_head_file_bytes_are_part_of_the_up_to_date_check(tmp_path):
    from kvpack.build import build, discover_contexts

    model, tok = tiny_model("llama")
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    ctxs = discover_contexts([tmp_path / "a.txt"])
    path = _file_with_scores(tmp_path, "llama", torch.tensor([[0.2, 0.9], [0.8, 0.1]]))
    kw = dict(out_dir=tmp_path / "packs", method="kvzip-head", heads=path, ratio=0.5)
    assert not build(ctxs, model, tok, **kw)[0].skipped
    assert build(ctxs, model, tok, **kw)[0].skipped
    _file_with_scores(tmp_path, "llama", torch.tensor([[0.9, 0.2], [0.8, 0.1]]))  # same path, other scores
    assert not build(ctxs, model, tok, **kw)[0].skipped


def test_a_head_score_file_given_as_a_url_compresses_like_the_local_file(tmp_path):
    model, tok = tiny_model("llama")
    spec = model_spec(model)
    scores = torch.arange(len(spec.compressed_layers) * spec.num_kv_heads, dtype=torch.float32).reshape(
        len(spec.compressed_layers), spec.num_kv_heads)
    path = _file_with_scores(tmp_path, "llama", scores)
    url = "memory://heads-url-test/h.safetensors"
    import fsspec

    fsspec.filesystem("memory").pipe_file("/heads-url-test/h.safetensors", open(path, "rb").read())
    local = kvpack.compress(model, tok, TEXT, method="kvzip-head", heads=path, ratio=0.5)
    remote = kvpack.compress(model, tok, TEXT, method="kvzip-head", heads=url, ratio=0.5)
    assert [l.head_lengths.tolist() for l in local.layers] == [l.head_lengths.tolist() for l in remote.layers]
    assert local.metadata["method_params"]["heads_sha256"] == remote.metadata["method_params"]["heads_sha256"]
