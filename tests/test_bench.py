"""``kvpack bench``: the shared-prefill builds equal ``kvpack.compress``; ``--quick`` writes sane JSON/Markdown/PNG;
the kvpress peer's job and scoring (without kvpress itself, which lives in its own environment)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import kvpack
from kvpack import tasks
from kvpack.bench.continuation import summarize_continuation
from kvpack.bench.grid import Variant, build_variants, expand_grid
from kvpack.bench.peer import baseline_agreement, export_job, peer_rows
from kvpack.bench.qa import QAContext
from kvpack.bench.report import require_matplotlib
from kvpack.bench.runner import BenchConfig, estimate_seconds
from kvpack.bench.speed import linear_growth
from kvpack.cli import cli
from kvpack.errors import InputError
from kvpack.fileformat import pack_to_bytes
from kvpack.layout import chat_layout
from kvpack.methods import METHODS

from .tiny import TEXT, required_options, tiny_model


@pytest.mark.parametrize("method", sorted(METHODS))
def test_build_variants_equal_compress(method):
    """One prefill + one scoring pass for all ratios gives exactly the bytes of separate kvpack.compress calls."""
    model, tok = tiny_model("llama")
    text = TEXT * 2
    required = required_options(method, "llama")
    built = build_variants(model, tok, text, method, [1.0, 0.5, 0.2], ["none", "int4"], chunk_size=64, **required)
    assert len(built) == 6
    for b in built:
        ratio = 1.0 if method == "none" else b.variant.ratio
        ref = kvpack.compress(model, tok, text, method=method, ratio=ratio, quant=b.variant.quant, chunk_size=64,
                              source_name="<bench>", **required)
        assert pack_to_bytes(b.pack, 0) == pack_to_bytes(ref, 0), b.variant.label
        assert b.build_s > 0


def test_expand_grid():
    vs = expand_grid(["kvzip", "streaming"], [1.0, 0.5, 0.1], ["none", "int4"])
    assert vs[:2] == [Variant("none", 1.0, "none"), Variant("none", 1.0, "int4")]
    assert all(v.ratio < 1.0 for v in vs[2:]) and len(vs) == 2 + 2 * 2 * 2
    assert Variant("snapkv", 0.3, "int4", True).label == "snapkv-q@0.3/int4"
    for bad in (dict(methods=["nope"]), dict(quants=["int3"]), dict(ratios=[1.5])):
        args = dict(methods=["kvzip"], ratios=[0.5], quants=["none"]) | bad
        with pytest.raises(InputError):
            expand_grid(**args)


def test_config_checks_and_estimate():
    with pytest.raises(InputError, match="unknown task"):
        BenchConfig(tasks=["needle", "speeed"]).check()
    with pytest.raises(InputError, match="peer"):
        BenchConfig(peer="other").check()
    quick, full = estimate_seconds(BenchConfig.quick()), estimate_seconds(BenchConfig())
    assert quick["total"] < 180 and full["total"] < 20 * 60
    assert estimate_seconds(BenchConfig(peer="kvpress"))["total"] < 20 * 60


def test_linear_growth():
    rows = [{"tokens": 1024, "growth_bytes": 100}, {"tokens": 4096, "growth_bytes": 300},
            {"tokens": 16384, "growth_bytes": 900}, {"tokens": 32768, "error": "timed out"}]
    lin = linear_growth(rows)
    assert lin["from_tokens"] == 4096 and lin["to_tokens"] == 16384 and lin["linear"]
    assert not linear_growth([{"tokens": 1, "growth_bytes": 1}, {"tokens": 2, "growth_bytes": 9}])["linear"]
    assert linear_growth(rows[:1]) is None


def test_require_matplotlib_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(InputError, match=r"kvpack\[bench\]"):
        require_matplotlib()


def test_peer_job_and_scoring():
    """The job carries kvpack's exact token ids; kvpress answers are scored like kvpack's."""
    _, tok = tiny_model("llama")
    facts = (tasks.Fact("Alice", "48213"), tasks.Fact("Bruno", "5150"))
    ctx = QAContext("multiquery/64/c0", "multiquery", TEXT, facts, 64, (0.25, 0.75))
    job = export_job([ctx], tok, "/models/m", ["kvzip", "snapkv"], [1.0, 0.5, 0.3])
    layout = chat_layout(tok)
    assert job["ratios"] == [0.5, 0.3] and job["baseline"] is True
    item = job["items"][0]
    assert item["context_ids"] == layout.prefix_ids(tok) + layout.encode(tok, TEXT)
    assert item["questions_ids"][1] == layout.question_ids(tok, "What is the secret code of Bruno?")
    results = {"rows": [
        {"task": "multiquery", "key": ctx.key, "press": "kvzip", "ratio": 0.5, "answers": ["It is 48213.", "5150"],
         "answer_s": [0.1, 0.1], "compress_s": 1.0, "kv_entries": 50, "kv_entries_full": 100},
        {"task": "multiquery", "key": ctx.key, "press": "none", "ratio": 1.0, "answers": ["a", "b"],
         "answer_s": [0.1, 0.1], "compress_s": 0.5, "kv_entries": 100, "kv_entries_full": 100},
        {"task": "multiquery", "key": ctx.key, "press": "snapkv", "ratio": 0.3, "error": "ValueError: x"}]}
    rows = peer_rows(results, [ctx])
    kv = [r for r in rows if r["variant"]["label"] == "kvpress:kvzip@0.5"]
    assert [r["correct"] for r in kv] == [True, True] and kv[0]["kept_fraction"] == 0.5
    assert any("error" in r for r in rows)
    full = [{"key": ctx.key, "question_index": i, "answer": a, "variant": {"name": "full"}} for i, a in
            enumerate(["a", "c"])]
    assert baseline_agreement(full + rows) == {"identical": 1, "total": 2}


def test_peer_continuation_job_and_rows():
    """Continuation passages go to kvpress with kvpack's exact ids; its rows are measured against its own run
    without a press, and the set-up check sets that run beside kvpack's full cache."""
    from kvpack.bench.continuation import ContinuationDoc
    from kvpack.bench.peer import continuation_baseline, peer_continuation_rows

    _, tok = tiny_model("llama")
    doc = ContinuationDoc("continuation/64/d0", TEXT, (5, 6, 7, 8), 64)
    job = export_job([], tok, "/models/m", ["kvzip"], [0.5], docs=[doc])
    layout = chat_layout(tok)
    assert job["items"] == [{"task": "continuation", "key": doc.key, "target_ids": [5, 6, 7, 8],
                             "context_ids": layout.prefix_ids(tok) + layout.encode_text(tok, TEXT)}]
    base = {"task": "continuation", "key": doc.key, "compress_s": 1.0, "kv_entries_full": 100}
    results = {"rows": [
        {**base, "press": "none", "ratio": 1.0, "nll": 2.0, "kl": 0.0, "top1_agreement": 1.0, "kv_entries": 100},
        {**base, "press": "kvzip", "ratio": 0.5, "nll": 2.25, "kl": 0.1, "top1_agreement": 0.75, "kv_entries": 50},
        {**base, "press": "snapkv", "ratio": 0.5, "error": "ValueError: x"}]}
    rows = peer_continuation_rows(results, [doc])
    kv = next(r for r in rows if r["variant"]["label"] == "kvpress:kvzip@0.5")
    assert kv["delta_nll"] == 0.25 and kv["kept_fraction"] == 0.5 and kv["target_tokens"] == 3
    assert any("error" in r for r in rows)
    full = {"key": doc.key, "nll": 1.999, "variant": {"name": "full"}}
    assert continuation_baseline([full, *rows]) == [{"key": doc.key, "kvpack": 1.999, "kvpress": 2.0}]
    summary = {s["label"]: s for s in summarize_continuation([{**r, "task": "continuation"} for r in rows])}
    assert set(summary) == {"kvpress:none@1", "kvpress:kvzip@0.5"}  # the failed press is left out


def test_kvpress_worker_teacher_forces_after_the_context():
    """The worker's continuation scoring (run in kvpress's environment; plain torch here): log-probabilities of the
    target fed through the prefilled cache at positions after the context equal one forward of context + target."""
    import importlib.util

    from transformers import DynamicCache

    spec = importlib.util.spec_from_file_location("kvpress_worker", Path(kvpack.bench.__file__).with_name(
        "kvpress_worker.py"))
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    model, tok = tiny_model("llama")
    ctx, target = tok.encode(TEXT)[:40], tok.encode(TEXT)[40:52]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
        want = torch.log_softmax(model(input_ids=torch.tensor([ctx + target[:-1]])).logits[0, len(ctx):].float(), -1)
    got = worker._teacher_forced(model, cache, target, len(ctx))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    scores = worker._continuation_scores(got, target, got)
    assert scores["kl"] == pytest.approx(0.0, abs=1e-6) and scores["top1_agreement"] == 1.0
    assert scores["nll"] == pytest.approx(float(-want.gather(1, torch.tensor(target[1:])[:, None]).mean()))
    assert worker._continuation_scores(got, target, None)["kl"] is None


def test_quick_cli(tmp_path):
    """``kvpack bench --quick`` on the reference model (needle at 512 tokens to stay short) writes sane outputs."""
    out = tmp_path / "bench"
    res = CliRunner().invoke(cli, ["bench", "--quick", "--lengths", "512", "--out", str(out), "--threads", "1"])
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert results["command"] == "kvpack bench --lengths 512 --out " + str(out) + " --quick --threads 1"
    assert "## Needle retrieval" in md and "## Multi-query reuse" in md and "## Continuation" in md
    assert "kvzip" in md and "## Speed and size" in md
    for name in results["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"needle_accuracy.png", "multiquery_accuracy.png", "size_vs_accuracy.png"} <= set(results["plots"])

    needle = {s["label"]: s for s in results["needle"]["summary"]}
    assert {"full", "none@1", "kvzip@0.3", "streaming@0.3"} <= set(needle)
    for s in results["needle"]["summary"] + results["multiquery"]["summary"]:
        assert 0.0 <= s["accuracy"] <= 1.0 and s["n"] > 0
    assert needle["none@1"]["accuracy"] == needle["full"]["accuracy"]
    assert needle["full"]["n"] == 11  # depths 0, 0.1, ..., 1
    rows = results["needle"]["rows"] + results["multiquery"]["rows"]
    full = {(r["key"], r["question_index"]): r["answer"] for r in rows if r["variant"]["name"] == "full"}
    none = {(r["key"], r["question_index"]): r["answer"] for r in rows if r["variant"]["name"] == "none"}
    assert none == full  # the keep-everything pack answers exactly as plain transformers
    kv = [r for r in rows if r["variant"]["label"] == "kvzip@0.3"]
    assert all(abs(r["kept_fraction"] - 0.3) < 0.01 and r["bytes_per_token"] > 0 for r in kv)
    mq = {s["label"]: s for s in results["multiquery"]["summary"]}
    assert "snapkv-q@0.3" in mq and mq["snapkv-q@0.3"]["first"] is not None

    cont = {s["label"]: s for s in results["continuation"]["summary"]}
    # the keep-everything pack differs from the full cache only by its float16 storage (--kv-dtype auto): 1.5e-4
    # nats/token on this passage (float32 packs met 1e-4)
    assert abs(cont["none@1"]["delta_nll"]) < 1e-3 and abs(cont["none@1"]["kl"]) < 1e-3
    assert cont["kvzip@0.3"]["kl"] >= 0 and cont["full"]["nll"] > 0

    speed = results["speed"]
    assert speed["prefill_s"] > 0 and set(speed["build_vs_prefill"]) == {"none", "kvzip", "streaming"}
    assert all(x > 0 for x in speed["load_speedup_vs_prefill"].values())
    assert speed["bytes_per_token"]["kvzip"] < speed["bytes_per_token"]["none"]
    mem = results["memory"]["rows"]
    assert [r["tokens"] for r in mem] == [1024, 2048, 4096]
    assert all("error" not in r and r["growth_bytes"] > 0 for r in mem)


def test_estimate_scales_with_the_model_measured_first():
    from kvpack.bench.runner import model_scale

    cfg = BenchConfig.quick()
    base, doubled = estimate_seconds(cfg), estimate_seconds(cfg, 2.0)
    assert set(base) == set(doubled) and all(doubled[k] == pytest.approx(2 * v) for k, v in base.items())
    model, tok = kvpack.load_model(None)
    assert 0.05 <= model_scale(model, tok) < 100  # the reference model is the cost model's own reference


def test_bench_cli_rejects_bad_options(tmp_path):
    res = CliRunner().invoke(cli, ["bench", "--quick", "--ratios", "0.5,2", "--out", str(tmp_path)])
    assert res.exit_code == 1 and "ratio" in res.output
    res = CliRunner().invoke(cli, ["bench", "--ratios", "a,b"])
    assert res.exit_code == 2


def test_bench_cli_context_length_and_contexts_reach_both_tasks(tmp_path, monkeypatch):
    """``--context-length`` and ``--contexts`` set the multi-query contexts and the continuation passages alike."""
    import kvpack.bench

    seen = {}

    def fake_run_bench(cfg, out_dir, **kwargs):
        seen["cfg"] = cfg
        return {}

    monkeypatch.setattr(kvpack.bench, "run_bench", fake_run_bench)
    res = CliRunner().invoke(cli, ["bench", "--quick", "--context-length", "8000", "--contexts", "2", "--depths",
                                   "0.25,0.75", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    cfg = seen["cfg"]
    assert (cfg.mq_length, cfg.cont_length, cfg.mq_contexts, cfg.cont_docs) == (8000, 8000, 2, 2)
    assert cfg.depths == [0.25, 0.75]
    res = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (seen["cfg"].mq_length, seen["cfg"].cont_docs) == (1024, 1)  # quick's own


def test_method_specs_name_options_and_build_like_compress():
    from kvpack.bench.specs import parse_method_spec

    assert parse_method_spec("d2o") == ("d2o", {})
    assert parse_method_spec("d2o[merge=values;beta=0.5;sink=2]") == ("d2o", {"merge": "values", "beta": 0.5,
                                                                               "sink": 2})
    assert parse_method_spec("kvzip[scoring=plus]") == ("kvzip", {"scoring": "plus"})
    for bad, fragment in (("d2o[merge]", "write key=value"), ("nope[x=1]", "unknown method"),
                          ("d2o[sink=1;sink=2]", "given twice"), ("d2o merge", "bad method spec")):
        with pytest.raises(InputError, match=fragment):
            parse_method_spec(bad)
    model, tok = tiny_model("llama")
    built = build_variants(model, tok, TEXT, "d2o[merge=values]", [0.5], ["none"], chunk_size=64)
    ref = kvpack.compress(model, tok, TEXT, method="d2o", merge="values", ratio=0.5, chunk_size=64,
                          source_name="<bench>")
    assert built[0].variant.label == "d2o[merge=values]@0.5"
    assert pack_to_bytes(built[0].pack, 0) == pack_to_bytes(ref, 0)
    assert expand_grid(["d2o[merge=off]"], [0.5], ["none"])[1] == Variant("d2o[merge=off]", 0.5, "none")


def test_haystack_folder_gives_the_contexts_and_bad_folders_are_refused(tmp_path, monkeypatch):
    """``--haystack DIR``: the contexts come from the .txt/.md files in DIR; a folder that is missing, empty, too
    large, not UTF-8 or without a passage as long as asked is refused with an ``InputError`` naming it."""
    from kvpack.bench.continuation import continuation_docs
    from kvpack.bench.multiquery import multiquery_contexts

    _, tok = tiny_model("llama")
    own = tmp_path / "docs"
    own.mkdir()
    words = " ".join(f"zebra{i % 97}" for i in range(3000))
    (own / "a.md").write_text("Zebras graze.\n\n" + words, encoding="utf-8")
    (own / "ignored.rst").write_text("not read", encoding="utf-8")
    docs = tasks.haystack_documents(own)
    assert len(docs) == 1 and docs[0].startswith("Zebras graze.")
    doc = continuation_docs(tok, 200, 1, 16, seed=3, documents=docs)[0]
    assert "zebra" in doc.text and doc.text not in "\n\n".join(tasks.haystack_documents())
    ctx = multiquery_contexts(tok, 200, 2, 1, seed=3, documents=docs)[0]
    assert "zebra" in ctx.text and all(f.code in ctx.text for f in ctx.facts)
    (tmp_path / "file.txt").write_text("x", encoding="utf-8")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.rst").write_text("not read", encoding="utf-8")
    (own / "sub").mkdir()  # only directly in the folder: a subfolder's files are not read
    (own / "sub" / "b.txt").write_text("nested", encoding="utf-8")
    assert tasks.haystack_documents(own) == docs
    for bad, why in ((tmp_path / "missing", "does not exist"), (tmp_path / "file.txt", "not a directory"),
                     (own / "sub" / "b.txt" / "x", "does not exist"), (tmp_path / "empty", "no .txt or .md")):
        with pytest.raises(InputError, match=why):
            tasks.haystack_documents(bad)
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "x.txt").write_bytes(b"caf\xe9 " * 10)
    with pytest.raises(InputError, match="not UTF-8"):
        tasks.haystack_documents(tmp_path / "latin1")
    monkeypatch.setattr(tasks, "MAX_HAYSTACK_BYTES", 100)
    with pytest.raises(InputError, match="over the 100"):
        tasks.haystack_documents(own)
    import random

    with pytest.raises(InputError, match="no passage of about 5000 tokens"):  # bounded, not an endless loop
        tasks.needle_context(tok, 5000, [tasks.random_fact(random.Random(0))], [0.5], random.Random(0),
                             ["too short"])
    with pytest.raises(InputError, match="--context-length"):
        continuation_docs(tok, 5000, 1, 16, documents=["too short"])
    # when the random starts all miss (here: none are tried), the ordered scan still finds a passage: the first
    # paragraph start, in order, that leads to one long enough
    short_then_long = ["a\n\nb\n\n" + words]
    monkeypatch.setattr(tasks, "PASSAGE_TRIES", 0)
    doc = continuation_docs(tok, 200, 1, 16, seed=0, documents=short_then_long)[0]
    assert doc.text.startswith("a")  # start 0 already reaches far enough into the long paragraph
    assert "zebra" in tasks.needle_context(tok, 200, [tasks.random_fact(random.Random(1))], [0.5], random.Random(1),
                                           short_then_long)
    assert tasks.first_long_passage(tok, short_then_long[0], [0, 3, 6], 10**6, 100) == []
    with pytest.raises(InputError, match="--context-length"):
        continuation_docs(tok, 200, 1, 16, documents=["too short"])
    monkeypatch.undo()
    monkeypatch.undo()
    import pathlib

    def unreadable(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pathlib.Path, "open", unreadable)
    with pytest.raises(InputError, match="cannot be read"):
        tasks.haystack_documents(own)


def test_bench_cli_haystack_reaches_the_run_and_a_bad_one_exits_cleanly(tmp_path, monkeypatch):
    import kvpack.bench

    seen = {}
    monkeypatch.setattr(kvpack.bench, "run_bench", lambda cfg, out_dir, **kw: seen.setdefault("cfg", cfg) and {})
    res = CliRunner().invoke(cli, ["bench", "--quick", "--haystack", str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert seen["cfg"].haystack == str(tmp_path)
    monkeypatch.undo()
    res = CliRunner().invoke(cli, ["bench", "--quick", "--no-plots", "--haystack", str(tmp_path / "nowhere"),
                                   "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and "does not exist" in res.output and "Traceback" not in res.output
