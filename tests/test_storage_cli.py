"""``kvpack build/info/verify/ask/ls`` on URLs: inputs and ``--out`` on memory:// and S3 (moto on 127.0.0.1), a
pack read over http; resume against S3 reads only headers; Parquet inputs; ``--storage-option``."""

from __future__ import annotations

import json

import pytest
from kvpack import storage
from kvpack.build import default_out_dir
from kvpack.manifest import MANIFEST_NAME
from kvpack.inputs import discover_contexts
from kvpack.fileformat import read_header

from .servers import clean_memory, http, s3  # noqa: F401 (fixtures)
from .test_cli import _run
from .test_cli_batch import llama  # noqa: F401 (fixture: the tiny llama saved to a folder)
from .tiny import TEXT

DOCS = {"alpha.txt": TEXT[:150], "sub/beta.md": "# Log\n" + TEXT[150:270],
        "gamma.jsonl": json.dumps({"id": "q1", "text": TEXT[200:320]}) + "\n"}
PACKS = ["alpha.kvpack", "gamma/q1.kvpack", "sub/beta.kvpack"]


@pytest.fixture(autouse=True)
def _empty_memory(clean_memory):
    yield


@pytest.fixture(scope="module")
def local(llama, tmp_path_factory):
    """The same documents built locally: name -> bytes of each pack."""
    root = tmp_path_factory.mktemp("local")
    for name, text in DOCS.items():
        (root / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "docs" / name).write_text(text, encoding="utf-8")
    # float32 packs: their tensor data outweighs the header (16-bit packs of these short documents are half header),
    # so the traffic bound below tells a header read from a whole-file read
    _run(["build", str(root / "docs"), "--out", str(root / "packs"), "--model", llama, "--chunk-size", "64",
          "--kv-dtype", "float32"])
    return {p: (root / "packs" / p).read_bytes() for p in PACKS}


def _flags(options: dict) -> list[str]:
    """``--storage-option KEY=VALUE`` flags for a storage_options dict (nested dicts as dotted keys)."""
    out = []
    for key, value in options.items():
        if isinstance(value, dict):
            out += [f for k, v in value.items() for f in ("--storage-option", f"{key}.{k}={json.dumps(v)}")]
        else:
            out += ["--storage-option", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return out


def _put_docs(base: str, options: dict | None = None) -> None:
    for name, text in DOCS.items():
        storage.write_atomic(f"{base}/{name}", text.encode("utf-8"), options)


def test_discovery_and_default_out_dir_on_urls():
    _put_docs("memory://corpus/docs")
    ctxs = discover_contexts(["memory://corpus/docs"])
    assert [c.name for c in ctxs] == ["alpha", "gamma/q1", "sub/beta"]  # the tree mirrored, as for a local folder
    assert ctxs[2].file == "memory://corpus/docs/sub/beta.md" and ctxs[2].source_name == "sub/beta.md"
    assert ctxs[1].where == "memory://corpus/docs/gamma.jsonl:1" and ctxs[0].text == DOCS["alpha.txt"]
    assert default_out_dir(["s3://bucket/docs/"]) == "s3://bucket/packs"
    assert default_out_dir(["s3://bucket/docs/a.txt"]) == "s3://bucket/docs/packs"


def test_a_parquet_dataset_of_texts_by_url_gives_one_context_per_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": ["a", "b", None], "text": [TEXT[:50], TEXT[50:90], TEXT[90:120]], "extra": [1, 2, 3]})
    pq.write_table(table, tmp_path / "set.parquet")
    storage.write_atomic("memory://corpus/set.parquet", (tmp_path / "set.parquet").read_bytes())
    ctxs = discover_contexts(["memory://corpus/set.parquet"])  # as jsonl lines: under a folder named after the file
    assert [(c.name, c.text, c.id, c.line, c.error) for c in ctxs] == [
        ("set/a", TEXT[:50], "a", 1, None), ("set/b", TEXT[50:90], "b", 2, None),
        ("set/3", TEXT[90:120], None, 3, None)]
    assert ctxs[0].source_name == "set.parquet:1"
    local = discover_contexts([tmp_path / "set.parquet"])
    assert [(c.name, c.text, c.line, c.file) for c in local] == [
        (c.name, c.text, c.line, tmp_path / "set.parquet") for c in ctxs]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    bad = discover_contexts([tmp_path / "bad.parquet", tmp_path / "junk.parquet"])  # failed contexts, not a stop
    assert [c.name for c in bad] == ["bad", "junk"] and 'no "text" column (columns: body)' in bad[0].error
    assert "not a readable Parquet file" in bad[1].error and bad[1].text is None


def test_build_from_and_to_memory_writes_the_local_bytes_and_info_verify_ask_read_them(llama, local):
    _put_docs("memory://corpus/docs")
    result = _run(["build", "memory://corpus/docs", "--out", "memory://corpus/packs", "--model", llama,
                   "--chunk-size", "64", "--kv-dtype", "float32"])
    assert "3 packs in memory://corpus/packs: 3 built, 0 up to date, 0 replaced; 0 failed" in result.output
    for p in PACKS:
        assert storage.read_bytes(f"memory://corpus/packs/{p}") == local[p]
    info = _run(["info", "memory://corpus/packs/alpha.kvpack"])
    assert "memory://corpus/packs/alpha.kvpack" in info.output and "alpha.txt" in info.output
    ok = _run(["verify", "memory://corpus/packs/sub/beta.kvpack", "--model", llama])
    assert "is intact" in ok.output and "fits model" in ok.output
    answer = _run(["ask", "memory://corpus/packs/alpha.kvpack", "What is this?", "--model", llama,
                   "--max-new-tokens", "4"])
    assert answer.output.strip()
    listed = [json.loads(l) for l in _run(["ls", "memory://corpus/packs", "--json"]).stdout.splitlines()]
    assert sorted(r["pack"] for r in listed) == PACKS
    again = _run(["build", "memory://corpus/docs", "--out", "memory://corpus/packs", "--model", llama,
                  "--chunk-size", "64", "--kv-dtype", "float32"])
    assert "0 built, 3 up to date, 0 replaced; 0 failed" in again.output
    assert len(storage.read_bytes(f"memory://corpus/packs/{MANIFEST_NAME}").splitlines()) == 3


def test_build_to_s3_then_resume_reads_only_headers(llama, local, s3):
    _put_docs("s3://packs/docs", s3.options)
    flags = _flags(s3.options)
    out = "s3://packs/run1"
    result = _run(["build", "s3://packs/docs", "--out", out, "--model", llama, "--chunk-size", "64", "--kv-dtype",
                   "float32", *flags])
    assert "3 built, 0 up to date" in result.output
    for p in PACKS:
        assert storage.read_bytes(f"{out}/{p}", s3.options) == local[p]
    headers = sum(read_header(f"{out}/{p}", storage_options=s3.options).header_bytes for p in PACKS)
    s3.traffic.reset()
    again = _run(["build", "s3://packs/docs", "--out", out, "--model", llama, "--chunk-size", "64", "--kv-dtype",
                  "float32", *flags])
    assert "0 built, 3 up to date" in again.output
    pack_gets = [r for r in s3.traffic.gets() if r[1].endswith(".kvpack")]
    assert pack_gets and all(rng is not None for _, _, rng in pack_gets)  # range reads only
    writes = [r for r in s3.traffic.requests if r[0] in ("PUT", "POST", "DELETE")]
    assert all(r[1].endswith(MANIFEST_NAME) for r in writes)  # no pack written; the manifest rewritten at the end
    spans = [[int(x) for x in rng.removeprefix("bytes=").split("-")] for _, _, rng in pack_gets]
    assert sum(end - start + 1 for start, end in spans) <= headers + 64 * len(PACKS)  # headers, no tensor data
    assert s3.traffic.sent < sum(len(b) for b in local.values()) / 2


def test_ask_reads_a_pack_served_over_http(llama, local, http):
    http.files["/packs/alpha.kvpack"] = local["alpha.kvpack"]
    http.traffic.reset()
    answer = _run(["ask", f"{http.url}/packs/alpha.kvpack", "What is this?", "--model", llama,
                   "--max-new-tokens", "4"])
    assert answer.output.strip()
    assert all(rng is not None for _, _, rng in http.traffic.gets())  # no whole-file GET
    assert http.traffic.sent <= len(local["alpha.kvpack"]) + 64


def test_bad_storage_options_and_read_only_out_are_one_line_errors(llama, http):
    http.files["/docs/a.txt"] = TEXT[:100].encode()
    bad = _run(["info", "memory://x.kvpack", "--storage-option", "novalue"], code=1)
    assert bad.output.startswith("error: --storage-option 'novalue': expected KEY=VALUE")
    ro = _run(["build", f"{http.url}/docs/a.txt", "--out", f"{http.url}/packs", "--model", llama], code=1)
    assert "read-only" in ro.output and ro.output.count("error:") == 1
