"""``kvpack.build``: discovering contexts, the default output folder, building, skipping and rebuilding packs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpack.build import (
    BuildResult,
    build,
    check_pack,
    default_out_dir,
    discover_contexts,
)
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
    assert [c.name for c in ctxs] == ["a", "b", "q-first", "q-3", "q-7"]
    assert [c.text for c in ctxs] == ["# ay", "bee", "one", "two", "three"]
    assert [c.line for c in ctxs] == [None, None, 1, 3, 4]
    assert ctxs[2].source == docs / "z" / "q.jsonl"
    assert ctxs[3].where.endswith("q.jsonl:3") and ctxs[3].source_name == "q.jsonl:3"
    assert discover_contexts([docs]) == ctxs  # deterministic
    assert discover_contexts([docs / "b.txt", docs]) == [ctxs[1], ctxs[0], *ctxs[2:]]  # each file once


def test_discover_keeps_the_order_of_inputs_and_sanitises_names(tmp_path):
    (tmp_path / "z.txt").write_text("zed", encoding="utf-8")
    (tmp_path / "a b.txt").write_text("ay", encoding="utf-8")
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": "../x/y", "text": "t"}) + "\n", encoding="utf-8")
    ctxs = discover_contexts([tmp_path / "z.txt", tmp_path / "a b.txt", tmp_path / "d.jsonl"])
    assert [c.name for c in ctxs] == ["z", "a_b", "d-_x_y"]


@pytest.mark.parametrize("lines, fragment", [
    (['{"text": "ok"}', "{not json"], "d.jsonl:2: not valid JSON"),
    (['{"id": 1}'], 'd.jsonl:1: no string "text"'),
    (['{"text": 5}'], 'd.jsonl:1: no string "text"'),
    (['["text"]'], 'd.jsonl:1: no string "text"'),
    (['{"text": "  "}'], 'd.jsonl:1: the "text" field is empty'),
    (['{"text": "a", "id": true}'], 'd.jsonl:1: "id" must be'),
    (['{"text": "a", "id": "x"}', '{"text": "b", "id": "x"}'], "d.jsonl:1 and"),
    ([""], "d.jsonl: no lines"),
])
def test_discover_rejects_bad_jsonl_lines_naming_file_and_line(tmp_path, lines, fragment):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(InputError) as err:
        discover_contexts([tmp_path])
    assert fragment in str(err.value)


def test_discover_errors(tmp_path):
    (tmp_path / "doc.pdf").write_bytes(b"%PDF")
    with pytest.raises(InputError, match=r"doc\.pdf: unsupported file type '\.pdf'"):
        discover_contexts([tmp_path / "doc.pdf"])
    with pytest.raises(InputError, match="nope: no such file or folder"):
        discover_contexts([tmp_path / "nope"])
    with pytest.raises(InputError, match="no .txt, .md or .jsonl files found"):
        discover_contexts([tmp_path])  # only the pdf, which a folder walk skips
    with pytest.raises(InputError, match="no input given"):
        discover_contexts([])
    (tmp_path / "empty.txt").write_text(" \n", encoding="utf-8")
    with pytest.raises(InputError, match="empty.txt: the file is empty"):
        discover_contexts([tmp_path / "empty.txt"])
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(InputError, match="latin.txt: not valid UTF-8"):
        discover_contexts([tmp_path / "latin.txt"])


def test_discover_rejects_two_contexts_with_one_output_name(tmp_path):
    (tmp_path / "notes.txt").write_text("a", encoding="utf-8")
    (tmp_path / "notes.md").write_text("b", encoding="utf-8")
    with pytest.raises(InputError, match=r"notes\.md and .*notes\.txt would both be written to notes\.kvpack"):
        discover_contexts([tmp_path])
    (tmp_path / "notes.md").unlink()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "Notes.txt").write_text("c", encoding="utf-8")  # case-insensitive file systems
    with pytest.raises(InputError, match="would both be written"):
        discover_contexts([tmp_path])


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
    def __init__(self, total, initial):
        self.total, self.n, self.closed, self.updates = total, initial, False, []

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
    assert [r.name for r in first] == ["alpha", "beta"]
    assert [r.path for r in first] == [out / "alpha.kvpack", out / "beta.kvpack"]
    assert not any(r.skipped for r in first)
    for r in first:
        assert isinstance(r, BuildResult) and r.seconds >= 0
        pack = load_pack(r.path)
        assert r.tokens == pack.original_tokens and r.entries_kept == pack.kept_entries()
        assert r.bytes_written == r.path.stat().st_size
        assert pack.metadata["source"]["name"] == r.path.stem + (".txt" if r.name == "alpha" else ".md")
    bar = bars[0]
    assert bar.closed and bar.total == sum(r.tokens for r in first) == bar.n and len(bar.updates) > 2

    # same settings: nothing rebuilt, results describe the existing files, no progress bar
    stamps = _mtimes(first)
    again = build(ctxs, model, tok, out_dir=out, ratio=0.3, chunk_size=64, progress_factory=factory)
    assert all(r.skipped for r in again) and len(bars) == 1
    assert _mtimes(again) == stamps
    assert [(r.tokens, r.entries_kept, r.bytes_written) for r in again] == \
        [(r.tokens, r.entries_kept, r.bytes_written) for r in first]

    # another ratio rebuilds; overwrite rebuilds
    other = build(ctxs, model, tok, out_dir=out, ratio=0.5, chunk_size=64)
    assert not any(r.skipped for r in other)
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
    data = bytearray((out / "beta.kvpack").read_bytes())
    data[-3] ^= 0x10
    (out / "beta.kvpack").write_bytes(bytes(data))
    res = build(discover_contexts([docs]), model, tok, out_dir=out, ratio=0.3, chunk_size=64)
    assert [r.skipped for r in res] == [False, False]
    verify(out / "beta.kvpack")
    (out / "beta.kvpack").write_bytes(b"not a pack")
    res = build(discover_contexts([docs]), model, tok, out_dir=out, ratio=0.3, chunk_size=64)
    assert [r.skipped for r in res] == [True, False]
    qwen, qtok = tiny_model("qwen2")
    res = build(discover_contexts([docs / "alpha.txt"]), qwen, qtok, out_dir=out, ratio=0.3, chunk_size=64)
    assert not res[0].skipped
    assert load_pack(out / "alpha.kvpack").metadata["fingerprint"]["architecture"] == "Qwen2ForCausalLM"


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
