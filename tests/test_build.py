"""``kvpack.build``: discovering contexts, the default output folder, building, skipping and rebuilding packs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import torch

from kvpack.build import (
    BuildResult,
    BuildSettings,
    build,
    check_pack,
    default_out_dir,
    discover_contexts,
    plan_build,
    run_build,
)
from kvpack.manifest import read_manifest
from kvpack.inputs import split_text
from kvpack.errors import InputError, ModelMismatchError
from kvpack.fileformat import load_pack, read_header, verify

from .tiny import TEXT, tiny_model

# short documents keep each compression well under a second on a tiny model
DOC_A = TEXT[:160]
DOC_B = TEXT[150:300]


def _docs(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "alpha.txt").write_text(DOC_A, encoding="utf-8")
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / "beta.md").write_text(DOC_B, encoding="utf-8")
    return folder


# ---------------------------------------------------------------------------------------------------------------
# discover_contexts


def test_discover_reads_txt_md_jsonl_recursively_in_sorted_order(tmp_path):
    docs = tmp_path / "docs"
    (docs / "z").mkdir(parents=True)
    (docs / "b.txt").write_text("bee", encoding="utf-8")
    (docs / "a.md").write_text("# ay", encoding="utf-8")
    (docs / "z" / "q.jsonl").write_text(
        json.dumps({"id": "first", "text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n"
        + json.dumps({"id": 7, "text": "three"}) + "\n", encoding="utf-8")
    (docs / "skip.pdf").write_bytes(b"%PDF")
    (docs / ".hidden.txt").write_text("no", encoding="utf-8")
    (docs / ".git").mkdir()
    (docs / ".git" / "x.txt").write_text("no", encoding="utf-8")
    ctxs = discover_contexts([docs])
    assert [c.name for c in ctxs] == ["a", "b", "z/q/first", "z/q/3", "z/q/7"]  # the tree, mirrored
    assert [c.text for c in ctxs] == ["# ay", "bee", "one", "two", "three"]
    assert [c.line for c in ctxs] == [None, None, 1, 3, 4]
    assert [c.id for c in ctxs] == [None, None, "first", None, "7"]
    assert ctxs[2].file == docs / "z" / "q.jsonl" and ctxs[2].source == "z/q.jsonl"
    assert ctxs[3].where.endswith("q.jsonl:3") and ctxs[3].source_name == "z/q.jsonl:3"
    assert ctxs[2].pack == "z/q/first.kvpack"
    assert all(c.error is None for c in ctxs)
    assert discover_contexts([docs]) == ctxs  # deterministic
    again = discover_contexts([docs / "b.txt", docs])  # each file once, in the order given
    assert [c.source for c in again] == ["docs/b.txt", "docs/a.md", *(["docs/z/q.jsonl"] * 3)]


def test_discover_mirrors_the_tree_and_keeps_unicode_names(tmp_path):
    docs = tmp_path / "docs"
    for rel in ("a/notes.txt", "b/notes.txt", "文档.txt", "报告.txt", "résumé.txt", "a b.txt", "what?.md"):
        (docs / rel).parent.mkdir(parents=True, exist_ok=True)
        (docs / rel).write_text("text", encoding="utf-8")
    (docs / "d.jsonl").write_text(json.dumps({"id": "../x/y", "text": "t"}) + "\n"
                                  + json.dumps({"id": "../x/y", "text": "u"}) + "\n", encoding="utf-8")
    names = {c.source + (f":{c.line}" if c.line else ""): c.name for c in discover_contexts([docs])}
    assert names == {"a/notes.txt": "a/notes", "b/notes.txt": "b/notes", "文档.txt": "文档", "报告.txt": "报告",
                     "résumé.txt": "résumé", "a b.txt": "a b", "what?.md": "what_",
                     "d.jsonl:1": "d/_._x_y", "d.jsonl:2": "d/_._x_y-2"}  # ids made unique, never hidden
    # two folder inputs mirror under their own names; two files keep their folders below the common parent
    assert [c.name for c in discover_contexts([docs / "a", docs / "b"])] == ["a/notes", "b/notes"]
    assert [c.name for c in discover_contexts([docs / "a" / "notes.txt", docs / "b" / "notes.txt"])] == [
        "a/notes", "b/notes"]
    assert [c.name for c in discover_contexts([docs / "a" / "notes.txt"])] == ["notes"]


def test_no_two_contexts_map_to_one_pack(tmp_path):
    (tmp_path / "x").mkdir()
    for rel in ("notes.txt", "notes.md", "x/Notes.txt", "x/notes.md", "notes-2.txt"):
        (tmp_path / rel).write_text(rel, encoding="utf-8")
    ctxs = discover_contexts([tmp_path])
    keys = [c.name.casefold() for c in ctxs]
    assert len(set(keys)) == len(keys) == 5
    by_text = {c.text: c.name for c in ctxs}
    assert by_text["notes-2.txt"] == "notes-2"  # a real name is never taken by a suffix
    assert by_text["notes.md"] == "notes" and by_text["notes.txt"] == "notes-3"
    assert {by_text["x/Notes.txt"], by_text["x/notes.md"]} == {"x/Notes", "x/notes-2"}


@pytest.mark.parametrize("lines, fragment", [
    (['{"text": "ok"}', "{not json"], "not valid JSON"),
    (['{"id": 1}'], 'no string "text"'),
    (['{"text": 5}'], 'no string "text"'),
    (['["text"]'], 'no string "text"'),
    (['{"text": "  "}'], 'the "text" field is empty'),
    (['{"text": "a", "id": true}'], '"id" must be'),
    ([""], "the file is empty"),
    (["[" * 100_000], "nested too deeply"),
    (['{"text": "a\\ud800"}'], "unpaired UTF-16 surrogate"),
])
def test_bad_jsonl_lines_are_marked_not_raised(tmp_path, lines, fragment):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ctxs = discover_contexts([tmp_path])
    bad = [c for c in ctxs if c.error is not None]
    assert len(bad) == 1 and fragment in bad[0].error and bad[0].text is None
    assert [c.text for c in ctxs if c.error is None] == (["ok"] if lines[0] == '{"text": "ok"}' else [])


def test_discover_errors_and_bad_files(tmp_path):
    (tmp_path / "doc.pdf").write_bytes(b"%PDF")
    with pytest.raises(InputError, match=r"doc\.pdf: unsupported file type '\.pdf'"):
        discover_contexts([tmp_path / "doc.pdf"])
    with pytest.raises(InputError, match="nope: no such file or folder"):
        discover_contexts([tmp_path / "nope"])
    with pytest.raises(InputError, match="no .txt, .md, .jsonl or .parquet files found"):
        discover_contexts([tmp_path])  # only the pdf, which a folder walk skips
    with pytest.raises(InputError, match="no input given"):
        discover_contexts([])
    (tmp_path / "empty.txt").write_text(" \n", encoding="utf-8")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "nul.txt").write_bytes(b"abc\x00def")
    (tmp_path / "good.txt").write_text("fine", encoding="utf-8")
    errors = {c.source: c.error for c in discover_contexts([tmp_path])}
    assert errors["good.txt"] is None
    assert errors["empty.txt"].startswith("the file is empty")
    assert errors["latin.txt"].startswith("not valid UTF-8 text (byte 3)")
    assert errors["nul.txt"].startswith("not text: it holds NUL bytes (byte 3")


def test_names_are_never_hidden_and_non_utf8_file_names_are_escaped(tmp_path):
    """A pack whose name starts with a dot would be a hidden file (``kvpack ls`` skips those); the bytes of a file
    name that is not UTF-8 are written as ``\\xNN`` in the source and replaced in the pack name; a backslash is a
    character of a POSIX file name, not a folder separator."""
    (tmp_path / ".notes.txt").write_text("hidden note", encoding="utf-8")
    (tmp_path / "d.jsonl").write_text('{"id": ".env", "text": "a"}\n{"id": "...", "text": "b"}\n', encoding="utf-8")
    names = [c.name for c in discover_contexts([tmp_path / ".notes.txt", tmp_path / "d.jsonl"])]
    assert names == ["_notes", "d/_env", "d/_"]
    if os.sep == "/":
        raw = os.path.join(os.fsencode(tmp_path), b"bad\xff.txt")
        with open(raw, "wb") as f:
            f.write(b"some text")
        (tmp_path / "a\\b.txt").write_text("slash", encoding="utf-8")
        by_text = {c.text: c for c in discover_contexts([tmp_path]) if c.text in ("some text", "slash")}
        assert (by_text["some text"].source, by_text["some text"].name) == ("bad\\xff.txt", "bad_xff")
        assert (by_text["slash"].source, by_text["slash"].name) == ("a\\b.txt", "a_b")


def test_a_walk_skips_a_builds_manifest_and_names_links_after_themselves(tmp_path):
    docs = tmp_path / "docs"
    (docs / "packs").mkdir(parents=True)
    (docs / "a.txt").write_text("text a", encoding="utf-8")
    (docs / "packs" / "kvpack-manifest.jsonl").write_text('{"pack": "a.kvpack"}\n', encoding="utf-8")
    assert [c.source for c in discover_contexts([docs])] == ["a.txt"]  # an --out inside the input folder
    if not hasattr(os, "symlink") or not hasattr(os, "mkfifo"):
        return
    (tmp_path / "target.txt").write_text("linked", encoding="utf-8")
    os.symlink(tmp_path / "target.txt", docs / "alias.txt")
    os.symlink("gone.txt", docs / "broken.txt")
    os.symlink(docs, docs / "loop")  # a folder link: never followed
    os.mkfifo(docs / "pipe.txt")  # reading it would block forever
    os.mkfifo(docs / "pipe.parquet")
    ctxs = {c.source: c for c in discover_contexts([docs])}
    assert set(ctxs) == {"a.txt", "alias.txt", "broken.txt", "pipe.txt", "pipe.parquet"}
    assert ctxs["pipe.parquet"].error.startswith("not a regular file")
    assert ctxs["alias.txt"].name == "alias" and ctxs["alias.txt"].text == "linked"
    assert ctxs["broken.txt"].name == "broken" and ctxs["broken.txt"].error.startswith("cannot read the file")
    assert ctxs["pipe.txt"].error.startswith("not a regular file")
    assert [c.source for c in discover_contexts([docs / "alias.txt", tmp_path / "target.txt"])] == ["docs/alias.txt"]


def test_a_bad_jsonl_line_never_takes_a_good_lines_name(tmp_path):
    (tmp_path / "q.jsonl").write_text('oops not json\n{"id": "1", "text": "good doc"}\n', encoding="utf-8")
    ctxs = discover_contexts([tmp_path])
    assert [(c.line, c.name, c.error is None) for c in ctxs] == [(1, "q/1-2", False), (2, "q/1", True)]


def test_a_source_path_longer_than_the_header_allows_is_recorded_by_its_end(tmp_path):
    deep = tmp_path / "docs"
    for k in range(5):  # 5 x 220 characters: a source path beyond the 1,024 a header's source name may hold
        deep = deep / (f"{k}" * 220)
    deep.mkdir(parents=True)
    (deep / "a.txt").write_text(TEXT[:200], encoding="utf-8")
    model, tok = tiny_model("llama")
    out = tmp_path / "out"
    (res,) = list(build(discover_contexts([tmp_path / "docs"]), model, tok, out_dir=out, chunk_size=64))
    assert res.status == "built", res.error
    name = load_pack(res.path).metadata["source"]["name"]
    assert len(name) == 1024 and name.startswith("\u2026") and name.endswith("4" * 200 + "/a.txt")


def test_a_pack_from_before_a_new_method_parameter_is_still_up_to_date(tmp_path):
    """A pack records its method's parameters; one built before a parameter existed (here AM's ``ridge_to``) records
    fewer, and is up to date when the new one is at its default."""
    import kvpack

    (tmp_path / "a.txt").write_text(TEXT[:300], encoding="utf-8")
    model, tok = tiny_model("llama")
    out = tmp_path / "out"
    ctxs = discover_contexts([tmp_path / "a.txt"])
    (first,) = list(build(ctxs, model, tok, out_dir=out, method="am", chunk_size=64))
    assert first.status == "built"
    pack = load_pack(first.path)
    del pack.metadata["method_params"]["ridge_to"]  # as the tenth session's kvpack wrote it
    kvpack.save(pack, first.path, zstd_level=3)
    (again,) = list(build(ctxs, model, tok, out_dir=out, method="am", chunk_size=64))
    assert again.status == "up_to_date"
    (same,) = list(build(ctxs, model, tok, out_dir=out, method="am", chunk_size=64, ridge=0.1,
                         ridge_to="selected"))
    assert same.status == "up_to_date"  # the ridge search (the default) makes the ridge inert: the same pack
    (other,) = list(build(ctxs, model, tok, out_dir=out, method="am", chunk_size=64, ridge=0.1,
                          ridge_to="selected", ridge_search=False))
    assert other.status == "replaced"  # another value of the new parameter, where it acts, is another pack


def test_default_out_dir_is_packs_beside_the_first_input(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("a", encoding="utf-8")
    assert default_out_dir([docs]) == tmp_path / "packs"
    assert default_out_dir([docs / "a.txt", tmp_path]) == docs / "packs"
    with pytest.raises(InputError):
        default_out_dir([])


# ---------------------------------------------------------------------------------------------------------------
# build


class _Bar:
    def __init__(self, total, initial=0):
        self.total, self.n, self.closed, self.updates, self.descriptions = total, initial, False, [], []

    def set_description(self, text, refresh=True):
        self.descriptions.append(text)

    def update(self, n):
        assert n > 0
        self.updates.append(n)
        self.n += n

    def close(self):
        self.closed = True


def _mtimes(results):
    return [os.stat(r.path).st_mtime_ns for r in results]


def test_build_writes_skips_and_rebuilds(tmp_path):
    model, tok = tiny_model("llama")
    ctxs = discover_contexts([_docs(tmp_path / "docs")])
    out = tmp_path / "packs"
    bars = []

    def factory(**kw):
        bars.append(_Bar(**kw))
        return bars[-1]

    first = build(ctxs, model, tok, out_dir=out, ratio=0.3, chunk_size=64, progress_factory=factory)
    assert [r.name for r in first] == ["alpha", "sub/beta"]
    assert [r.path for r in first] == [out / "alpha.kvpack", out / "sub" / "beta.kvpack"]
    assert [r.status for r in first] == ["built", "built"]
    for r in first:
        assert isinstance(r, BuildResult) and r.seconds >= 0
        pack = load_pack(r.path)
        assert r.tokens == pack.original_tokens and r.entries_kept == pack.kept_entries()
        assert r.bytes_written == r.path.stat().st_size
        assert pack.metadata["source"]["name"] == ("alpha.txt" if r.name == "alpha" else "sub/beta.md")
    bar = bars[0]
    assert bar.closed and bar.total == sum(r.tokens for r in first) == bar.n and len(bar.updates) > 2
    assert bar.descriptions == ["alpha", "sub/beta"]  # the bar names the context being built

    # same settings: nothing rebuilt, results describe the existing files, no progress bar
    stamps = _mtimes(first)
    again = build(ctxs, model, tok, out_dir=out, ratio=0.3, chunk_size=64, progress_factory=factory)
    assert all(r.skipped for r in again) and len(bars) == 1
    assert _mtimes(again) == stamps
    assert [(r.tokens, r.entries_kept, r.bytes_written) for r in again] == \
        [(r.tokens, r.entries_kept, r.bytes_written) for r in first]

    # another ratio rebuilds; overwrite rebuilds
    other = build(ctxs, model, tok, out_dir=out, ratio=0.5, chunk_size=64)
    assert [r.status for r in other] == ["replaced", "replaced"]
    assert load_pack(other[0].path).metadata["ratio"] == 0.5
    forced = build(ctxs, model, tok, out_dir=out, ratio=0.5, chunk_size=64, overwrite=True)
    assert not any(r.skipped for r in forced)
    # method parameters count too (kvzip's chunk_size)
    assert not any(r.skipped for r in build(ctxs, model, tok, out_dir=out, ratio=0.5, chunk_size=32))


def test_build_rebuilds_changed_text_damaged_files_and_other_models(tmp_path):
    model, tok = tiny_model("llama")
    docs = _docs(tmp_path / "docs")
    out = tmp_path / "packs"
    build(discover_contexts([docs]), model, tok, out_dir=out, ratio=0.3, chunk_size=64)
    (docs / "alpha.txt").write_text(DOC_A + " More.", encoding="utf-8")
    data = bytearray((out / "sub" / "beta.kvpack").read_bytes())
    data[-3] ^= 0x10
    (out / "sub" / "beta.kvpack").write_bytes(bytes(data))
    res = build(discover_contexts([docs]), model, tok, out_dir=out, ratio=0.3, chunk_size=64)
    assert [r.skipped for r in res] == [False, False]
    verify(out / "sub" / "beta.kvpack")
    (out / "sub" / "beta.kvpack").write_bytes(b"not a pack")
    res = build(discover_contexts([docs]), model, tok, out_dir=out, ratio=0.3, chunk_size=64)
    assert [r.skipped for r in res] == [True, False]
    qwen, qtok = tiny_model("qwen2")
    res = build(discover_contexts([docs / "alpha.txt"]), qwen, qtok, out_dir=out, ratio=0.3, chunk_size=64)
    assert not res[0].skipped
    assert load_pack(out / "alpha.kvpack").metadata["fingerprint"]["architecture"] == "Qwen2ForCausalLM"


def test_a_manifest_path_that_is_a_folder_is_refused_before_the_model_loads(tmp_path):
    (tmp_path / "out" / "kvpack-manifest.jsonl").mkdir(parents=True)
    (tmp_path / "a.txt").write_text("text", encoding="utf-8")
    with pytest.raises(InputError, match="kvpack-manifest.jsonl is not a file"):
        plan_build(discover_contexts([tmp_path / "a.txt"]), tmp_path / "out", BuildSettings.make())


def test_build_validates_settings_before_writing(tmp_path):
    model, tok = tiny_model("llama")
    ctxs = discover_contexts([_docs(tmp_path / "docs")])
    out = tmp_path / "packs"
    with pytest.raises(InputError, match=r"ratio must be in \(0, 1\]"):
        build(ctxs, model, tok, out_dir=out, ratio=1.5)
    with pytest.raises(InputError, match="unknown method 'nope'"):
        build(ctxs, model, tok, out_dir=out, method="nope")
    with pytest.raises(InputError, match="bad parameters for method 'kvzip'"):
        build(ctxs, model, tok, out_dir=out, colour="red")
    with pytest.raises(InputError, match="chunk_size"):
        build(ctxs, model, tok, out_dir=out, chunk_size=0)
    assert not out.exists()
    (tmp_path / "file").write_text("x", encoding="utf-8")
    with pytest.raises(InputError, match="output"):
        build(ctxs, model, tok, out_dir=tmp_path / "file")


def test_check_pack_checks_integrity_and_model(tmp_path):
    model, tok = tiny_model("llama")
    res = build(discover_contexts([_docs(tmp_path / "docs")]), model, tok, out_dir=tmp_path, ratio=0.3,
                chunk_size=64)
    path = res[0].path
    assert check_pack(path).file_bytes == res[0].bytes_written
    assert check_pack(path, model, tok).metadata["method"] == "kvzip"
    qwen, qtok = tiny_model("qwen2")
    with pytest.raises(ModelMismatchError, match="tiny-llama.*tiny-qwen2"):
        check_pack(path, qwen, qtok)


def test_build_skip_rule_includes_quantization_and_zstd(tmp_path):
    model, tok = tiny_model("llama")
    ctxs = discover_contexts([_docs(tmp_path / "docs")])
    kw = dict(out_dir=tmp_path / "packs", ratio=0.5, chunk_size=64)
    first = build(ctxs, model, tok, **kw)
    assert read_header(first[0].path).zstd_level == 3  # the library's build defaults to the CLI's zstd level
    assert all(r.skipped for r in build(ctxs, model, tok, **kw))
    for settings in (dict(zstd_level=0), dict(quant="int4"), dict(quant="int4", group_size=64),
                     dict(quant="int8", group_size=64), dict(quant="int8", group_size=64, zstd_level=9)):
        res = build(ctxs, model, tok, **kw, **settings)
        assert not any(r.skipped for r in res), settings
        again = build(ctxs, model, tok, **kw, **settings)
        assert all(r.skipped for r in again), settings
        h = read_header(res[0].path)
        quant = settings.get("quant", "none")
        assert (h.quant_type, h.group_size, h.zstd_level) == (
            quant, settings.get("group_size", 32) if quant != "none" else None, settings.get("zstd_level", 3))
        assert res[0].entries_kept == again[0].entries_kept == load_pack(res[0].path).kept_entries()
    with pytest.raises(InputError, match="group_size"):
        build(ctxs, model, tok, **kw, quant="int4", group_size=48)
    with pytest.raises(InputError, match="unknown quantization"):
        build(ctxs, model, tok, **kw, quant="int2")
    with pytest.raises(InputError, match="zstd_level"):
        build(ctxs, model, tok, **kw, zstd_level=23)


# ---------------------------------------------------------------------------------------------------------------
# keep going, manifest, resume, split


def _long_text(paragraphs: int) -> str:
    return "".join(f"Paragraph {i}. {TEXT[:150]}\n\n" for i in range(paragraphs))


def test_build_keeps_going_past_bad_contexts_and_records_why(tmp_path):
    model, tok = tiny_model("llama")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a_empty.txt").write_text("", encoding="utf-8")
    (docs / "b_long.txt").write_text(TEXT * 60, encoding="utf-8")  # > 4096 - 256 tokens
    (docs / "c_good.txt").write_text(DOC_A, encoding="utf-8")
    (tmp_path / "packs").mkdir()
    (tmp_path / "packs" / "d").write_text("a file where the folder d/ must go", encoding="utf-8")
    (docs / "d").mkdir()
    (docs / "d" / "x.txt").write_text(DOC_B, encoding="utf-8")
    (docs / "e_good.txt").write_text(DOC_B, encoding="utf-8")
    res = build(discover_contexts([docs]), model, tok, out_dir=tmp_path / "packs", ratio=0.3, chunk_size=64)
    assert [(r.name, r.status) for r in res] == [("a_empty", "failed"), ("b_long", "failed"), ("c_good", "built"),
                                                 ("d/x", "failed"), ("e_good", "built")]
    assert res[0].error.startswith("the file is empty")
    assert "too long for this model (at most 3,840)" in res[1].error and "--split" in res[1].error
    assert res[3].error.startswith("cannot write") and str(tmp_path / "packs" / "d") in res[3].error
    assert verify(res[2].path) and verify(res[4].path)
    records = read_manifest(tmp_path / "packs")
    assert {k: v["status"] for k, v in records.items()} == {
        "a_empty.kvpack": "failed", "b_long.kvpack": "failed", "c_good.kvpack": "built", "d/x.kvpack": "failed",
        "e_good.kvpack": "built"}
    good = records["c_good.kvpack"]
    assert (good["source"], good["tokens"], good["entries_kept"], good["bytes"]) == (
        "c_good.txt", res[2].tokens, res[2].entries_kept, res[2].path.stat().st_size)
    assert good["settings"]["ratio"] == 0.3 and good["settings"]["method"] == "kvzip"
    assert good["weights_sha256"] == load_pack(res[2].path).metadata["fingerprint"]["weights_sha256"]
    assert records["b_long.kvpack"]["error"] == res[1].error

    fast = build(discover_contexts([docs]), model, tok, out_dir=tmp_path / "fast", ratio=0.3, chunk_size=64,
                 fail_fast=True)
    assert [(r.name, r.status) for r in fast] == [("a_empty", "failed")]


def test_plan_trusts_the_manifest_so_an_up_to_date_run_needs_no_model(tmp_path):
    model, tok = tiny_model("llama")
    docs = _docs(tmp_path / "docs")
    out = tmp_path / "packs"
    ident = {"name": "tiny", "dtype": "float32", "local": True, "files_sha256": "0" * 64}
    settings = BuildSettings.make(ratio=0.3, chunk_size=64)
    plan = plan_build(discover_contexts([docs]), out, settings, model_id=ident)
    assert plan.needs_model
    run = run_build(plan, model, tok)
    first = next(run)  # interrupted after the first pack: the manifest already holds it
    run.close()
    assert read_manifest(out)["alpha.kvpack"]["status"] == "built"
    plan = plan_build(discover_contexts([docs]), out, settings, model_id=ident)
    assert plan.up_to_date == 1 and plan.needs_model  # beta still to build
    assert [r.status for r in run_build(plan, model, tok)] == ["up_to_date", "built"]
    plan = plan_build(discover_contexts([docs]), out, settings, model_id=ident)
    assert not plan.needs_model and plan.up_to_date == 2
    again = list(run_build(plan))  # no model at all
    assert [(r.status, r.bytes_written) for r in again] == [("up_to_date", first.bytes_written),
                                                           ("up_to_date", again[1].path.stat().st_size)]
    # a default spelled out is the same build: the manifest still answers without the model
    spelled = BuildSettings.make(ratio=0.3, chunk_size=64, scoring="attention", max_head_ratio=1.0)
    plan = plan_build(discover_contexts([docs]), out, spelled, model_id=ident)
    assert not plan.needs_model and plan.up_to_date == 2
    plan = plan_build(discover_contexts([docs]), out, BuildSettings.make(ratio=0.3, chunk_size=64, scoring="plus"),
                      model_id=ident)
    assert plan.needs_model and plan.up_to_date == 0  # another parameter value is another build
    # another model identity, other settings, a changed text or a damaged pack: not trusted without the model
    assert plan_build(discover_contexts([docs]), out, settings, model_id={**ident, "files_sha256": "1" * 64}
                      ).up_to_date == 0
    assert plan_build(discover_contexts([docs]), out, BuildSettings.make(ratio=0.5, chunk_size=64),
                      model_id=ident).up_to_date == 0
    (docs / "alpha.txt").write_text(DOC_A + "!", encoding="utf-8")
    data = bytearray((out / "sub" / "beta.kvpack").read_bytes())
    data[-3] ^= 1
    (out / "sub" / "beta.kvpack").write_bytes(bytes(data))
    assert plan_build(discover_contexts([docs]), out, settings, model_id=ident).up_to_date == 0
    (tmp_path / "ro").write_text("x", encoding="utf-8")
    with pytest.raises(InputError, match="not a folder"):
        plan_build(discover_contexts([docs]), tmp_path / "ro", settings)


def _short_model(limit_tokens: int):
    """The tiny llama with max_position_embeddings = limit + 256 (contexts of at most ``limit`` tokens)."""
    from transformers import AutoModelForCausalLM

    from .tiny import tiny_config, tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = tiny_config("llama", len(tok))
    cfg.max_position_embeddings = limit_tokens + 256
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    model.kvpack_name = "tiny-short"
    return model, tok


def test_split_cuts_long_contexts_at_paragraphs_into_valid_parts(tmp_path):
    model, tok = _short_model(200)
    text = _long_text(6)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "long.txt").write_text(text, encoding="utf-8")
    ctxs = discover_contexts([tmp_path / "docs"])
    out = tmp_path / "packs"
    assert build(ctxs, model, tok, out_dir=out, ratio=0.3, chunk_size=64)[0].status == "failed"
    ident = {"name": "tiny", "local": True, "files_sha256": "0"}
    res = build(ctxs, model, tok, out_dir=out, ratio=0.3, chunk_size=64, split=True, model_id=ident)
    assert len(res) >= 3 and [r.name for r in res] == [f"long.part-{k:03d}" for k in range(1, len(res) + 1)]
    assert all(r.status == "built" and r.parts == len(res) for r in res) and [r.part for r in res] == list(
        range(1, len(res) + 1))
    pieces = []
    for r in res:
        pack = load_pack(r.path)
        assert pack.original_tokens <= 200
        piece = tok.decode(pack.token_ids[pack.sink_tokens:].tolist())
        assert piece.startswith("Paragraph ")  # cut at paragraph boundaries
        pieces.append(piece)
    assert "".join(pieces) == text
    settings = BuildSettings.make(ratio=0.3, chunk_size=64)
    plan = plan_build(ctxs, out, settings, model_id=ident)
    assert not plan.needs_model and plan.up_to_date == len(res)
    assert [r.name for r in run_build(plan)] == [r.name for r in res]


def test_progress_ends_at_its_total_past_failures_and_split_parts(tmp_path):
    """The bar counts the tokens to compress: not those of a context too long without --split (it fails before any
    work); a split context's parts fill exactly its share; a resumed run reports a known failure's tokens."""
    model, tok = _short_model(200)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a_long.txt").write_text(_long_text(6), encoding="utf-8")
    (docs / "b_short.txt").write_text("Paragraph 0. A short note.\n", encoding="utf-8")
    ctxs = discover_contexts([docs])
    ident = {"name": "tiny", "local": True, "files_sha256": "0"}

    def run(out, split):
        bars = []
        res = build(ctxs, model, tok, out_dir=tmp_path / out, ratio=0.3, chunk_size=64, split=split,
                    model_id=ident, progress_factory=lambda **kw: bars.append(_Bar(**kw)) or bars[-1])
        return res, bars

    res, bars = run("plain", split=False)
    assert [r.status for r in res] == ["failed", "built"] and res[0].tokens > 200
    assert bars[0].total == bars[0].n == res[1].tokens  # 100%, the failed context not counted
    again, bars = run("plain", split=False)  # resumed: the known failure keeps its tokens, nothing to build
    assert [(r.status, r.tokens) for r in again] == [("failed", res[0].tokens), ("up_to_date", res[1].tokens)]
    assert not bars
    res, bars = run("split", split=True)
    assert [r.status for r in res][-1] == "built" and len(res) >= 4 and all(r.status == "built" for r in res)
    assert bars[0].total == bars[0].n  # ends at 100% although the parts' tokens add up to more than the whole
    assert bars[0].total < sum(r.tokens for r in res)


def test_split_text_rules():
    fits = lambda t: len(t) <= 12  # noqa: E731
    assert split_text("aaaa\n\nbbbb\n\ncccc\n", fits) == ["aaaa\n\nbbbb\n\n", "cccc\n"]
    assert split_text("aaaaaa\nbbbbbb\ncc\n\ndd", fits) == ["aaaaaa\n", "bbbbbb\ncc\n\n", "dd"]
    with pytest.raises(InputError, match="single line"):
        split_text("x" * 20, fits)
    crlf = "aa\r\n\r\nbbb\r\ncccc\r\n"  # CRLF blank lines are paragraph boundaries too (not cut after bbb)
    assert split_text(crlf, fits) == ["aa\r\n\r\n", "bbb\r\ncccc\r\n"]
    assert split_text(crlf.replace("\r", ""), fits) == ["aa\n\n", "bbb\ncccc\n"]


def test_special_token_strings_in_a_document_are_text(tmp_path):
    model, tok = tiny_model("llama")
    text = "Before <|end|> middle <|user|> after."
    (tmp_path / "d.txt").write_text(text, encoding="utf-8")
    res = build(discover_contexts([tmp_path / "d.txt"]), model, tok, out_dir=tmp_path / "p", ratio=0.5,
                chunk_size=64)
    pack = load_pack(res[0].path)
    context = pack.token_ids[pack.sink_tokens:].tolist()
    assert not set(context) & set(tok.all_special_ids)
    assert tok.decode(context) == text


def test_hostile_manifest_lines_are_skipped():
    """A line nested past the parser's recursion limit, or holding an unpaired surrogate, is skipped like any line
    that is not a record (``kvpack ls`` and ``kvpack build`` read the manifest before anything else)."""
    from kvpack.manifest import parse_manifest

    good = json.dumps({"pack": "b.kvpack", "status": "built"})
    records = parse_manifest(["[" * 100_000, '{"pack": "a\\ud800.kvpack", "status": "built"}', good])
    assert list(records) == ["b.kvpack"]


def test_a_build_notes_attention_matching_heads_left_unfitted(tmp_path):
    """An AM pack whose reference queries are too few to fit most heads says so in its result (``kvpack build``
    prints it); a pack whose heads were fitted, and other methods, have no note."""
    from kvpack.methods.params import PARAMS

    (tmp_path / "a.txt").write_text(TEXT[:300], encoding="utf-8")
    model, tok = tiny_model("llama")
    ctxs = discover_contexts([tmp_path / "a.txt"])
    (few,) = list(build(ctxs, model, tok, out_dir=tmp_path / "few", method="am", ratio=0.5, chunk_size=64,
                        queries=16))
    # 16 queries, 2 held out: 14 fit queries / 8 per entry = 1 kept entry at most
    assert len(few.notes) == 1 and "fitted 0 of" in few.notes[0] and "14 fit queries" in few.notes[0], few.notes
    assert "= 1 kept entries; a larger --queries fits more" in few.notes[0], few.notes
    (kv,) = list(build(ctxs, model, tok, out_dir=tmp_path / "kv", method="kvzip", chunk_size=64))
    assert kv.notes == ()
    am = PARAMS["am"]
    params = {"queries": 8192, "queries_per_entry": 8.0}
    stats = {"context_entries": 90 * 100, "context_tokens": 100,
             "fit": {"heads_unfitted": 45, "queries": 3000, "held_out": 256}}
    assert am.build_notes(params, stats) == []  # half fitted: no note
    stats["fit"]["heads_unfitted"] = 46
    (note,) = am.build_notes(params, stats)
    assert note.startswith("Attention Matching fitted 44 of 90 KV heads; the other 46")
    # a short context gave fewer queries than --queries: more of them would change nothing
    assert "3,000 fit queries / --queries-per-entry 8 = 375 kept entries" in note and "fewer reference queries" in note
    assert am.build_notes(params, {"fit": "x"}) == [] and am.build_notes(params, {}) == []
