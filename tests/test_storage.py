"""``kvpack.storage`` and the readers/writers on URLs: memory://, a local HTTP server (Range reads), moto's S3."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
import torch

import kvpack
from kvpack import storage
from kvpack.errors import InputError, TruncatedFileError
from kvpack.fileformat import load_pack, pack_to_bytes, read_header, verify

from .servers import clean_memory, http, s3  # noqa: F401 (fixtures)
from .tiny import TEXT, tiny_model


@pytest.fixture(autouse=True)
def _empty_memory(clean_memory):
    yield


@pytest.fixture(scope="module")
def pack():
    model, tok = tiny_model("llama")
    return kvpack.compress(model, tok, TEXT[:220], method="kvzip", ratio=0.5)


def _same_pack(a, b) -> None:
    assert torch.equal(a.token_ids, b.token_ids) and a.metadata == b.metadata
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
        assert torch.equal(la.positions, lb.positions) and torch.equal(la.head_lengths, lb.head_lengths)


# ---------------------------------------------------------------------------------------------------------------
# paths and options


def test_urls_are_told_from_local_paths():
    assert storage.is_url("s3://bucket/key") and storage.is_url("memory://x") and storage.is_url("https://h/a")
    assert not storage.is_url("docs/a.txt") and not storage.is_url(Path("s3:/x")) and not storage.is_url("file:///tmp/a")
    assert not storage.is_url("C:\\docs\\a.txt")
    assert storage.join("s3://b/out/", "sub", "a.kvpack") == "s3://b/out/sub/a.kvpack"
    assert storage.join("out", "a.kvpack") == Path("out") / "a.kvpack"
    assert storage.as_path("file:///tmp/a.txt") == Path("/tmp/a.txt") and storage.as_path("s3://b/k") == "s3://b/k"
    assert storage.name_of("s3://b/docs/notes.md") == "notes.md" and storage.stem_of("s3://b/docs/notes.md") == "notes"


def test_write_method_per_backend(tmp_path):
    assert storage.write_method(tmp_path / "a.kvpack") == "replace"
    assert storage.write_method("s3://b/a.kvpack") == "put" and storage.write_method("gs://b/a") == "put"
    assert storage.write_method("memory://a.kvpack") == "move" and storage.write_method("sftp://h/a") == "move"
    with pytest.raises(InputError, match="read-only"):
        storage.write_method("https://example.org/a.kvpack")


def test_storage_options_parse_json_values_and_dotted_keys():
    got = storage.parse_storage_options(["endpoint_url=http://127.0.0.1:9000", "anon=true", "client_kwargs.region_name"
                                         "=eu-west-1", "config_kwargs.retries={\"max_attempts\": 2}", "key=a=b"])
    assert got == {"endpoint_url": "http://127.0.0.1:9000", "anon": True, "key": "a=b",
                   "client_kwargs": {"region_name": "eu-west-1"}, "config_kwargs": {"retries": {"max_attempts": 2}}}
    for bad, message in [("noequals", "KEY=VALUE"), ("=v", "KEY=VALUE"), ("a..b=1", "KEY=VALUE")]:
        with pytest.raises(InputError, match=message):
            storage.parse_storage_options([bad])
    with pytest.raises(InputError, match="twice"):
        storage.parse_storage_options(["anon=true", "anon=false"])


def test_a_missing_backend_names_the_package_to_install():
    with pytest.raises(InputError, match="pip install"):
        storage.read_bytes("gcs://bucket/a.txt")


# ---------------------------------------------------------------------------------------------------------------
# memory://


def test_memory_write_read_walk():
    assert storage.write_atomic("memory://out/a.kvpack", b"abc") == 3
    storage.write_atomic("memory://out/a.kvpack", b"defg")  # replaces
    storage.write_atomic("memory://docs/b.txt", b"b")
    storage.write_atomic("memory://docs/sub/a.md", b"a")
    storage.write_atomic("memory://docs/.hidden/c.txt", b"c")
    storage.write_atomic("memory://docs/skip.pdf", b"p")
    assert storage.read_bytes("memory://out/a.kvpack") == b"defg" and storage.file_size("memory://out/a.kvpack") == 4
    assert sorted(fsspec.filesystem("memory").store) == ["/docs/.hidden/c.txt", "/docs/b.txt", "/docs/skip.pdf",
                                                          "/docs/sub/a.md", "/out/a.kvpack"]  # no temporary names left
    assert storage.walk_files("memory://docs", (".txt", ".md")) == [("memory://docs/b.txt", ("b.txt",)),
                                                                    ("memory://docs/sub/a.md", ("sub", "a.md"))]
    assert storage.is_dir("memory://docs") and storage.is_file("memory://docs/b.txt")
    assert not storage.is_file("memory://docs") and not storage.is_file("memory://nothing")
    with pytest.raises(InputError, match="no such file"):
        storage.read_bytes("memory://nothing")


def test_memory_write_that_fails_leaves_the_old_file_and_no_temporary(monkeypatch):
    storage.write_atomic("memory://out/a.kvpack", b"old")
    fs = fsspec.filesystem("memory")

    def broken_move(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(fs), "mv", broken_move)
    with pytest.raises(InputError, match="No space left"):
        storage.write_atomic("memory://out/a.kvpack", b"new")
    assert storage.read_bytes("memory://out/a.kvpack") == b"old" and list(fs.store) == ["/out/a.kvpack"]


def test_save_and_load_on_memory_match_the_local_file(pack, tmp_path):
    local = tmp_path / "a.kvpack"
    n = kvpack.save(pack, local, zstd_level=3)
    assert kvpack.save(pack, "memory://packs/a.kvpack", zstd_level=3) == n
    assert storage.read_bytes("memory://packs/a.kvpack") == local.read_bytes()
    assert read_header("memory://packs/a.kvpack") == read_header(local)
    _same_pack(load_pack("memory://packs/a.kvpack"), load_pack(local))
    with open(local, "rb") as f:  # an open file object reads the same and stays open
        assert verify(f).file_bytes == n and not f.closed


def test_a_truncated_remote_pack_is_a_truncated_file_error(pack):
    data = pack_to_bytes(pack, 3)
    storage.write_atomic("memory://packs/cut.kvpack", data[:-10])
    with pytest.raises(TruncatedFileError, match="memory://packs/cut.kvpack"):
        load_pack("memory://packs/cut.kvpack")


# ---------------------------------------------------------------------------------------------------------------
# http(s):// (read-only, Range requests)


def test_http_header_read_fetches_only_the_header(pack, http):
    data = pack_to_bytes(pack, 3)
    http.files["/a.kvpack"] = data
    http.traffic.reset()
    header = read_header(f"{http.url}/a.kvpack")
    assert header.file_bytes == len(data)
    gets = http.traffic.gets()
    assert gets and all(rng is not None for _, _, rng in gets)  # ranged GETs only
    # the length prefix, the magic and the header (the parser peeks at the magic first), no tensor data
    assert header.header_bytes <= http.traffic.sent <= header.header_bytes + 64 < len(data) / 4


def test_http_load_reads_ranges_and_matches_the_local_pack(pack, http, tmp_path):
    data = pack_to_bytes(pack, 3)
    http.files["/b.kvpack"] = data
    (tmp_path / "b.kvpack").write_bytes(data)
    http.traffic.reset()
    loaded = load_pack(f"{http.url}/b.kvpack")
    _same_pack(loaded, load_pack(tmp_path / "b.kvpack"))
    assert len(data) <= http.traffic.sent <= len(data) + 64  # header, then the data region, in range requests
    assert all(rng is not None for _, _, rng in http.traffic.gets()) and len(http.traffic.gets()) <= 4
    with pytest.raises(InputError, match="read-only"):
        kvpack.save(pack, f"{http.url}/new.kvpack")
    with pytest.raises(InputError, match="cannot read"):
        read_header(f"{http.url}/missing.kvpack")


# ---------------------------------------------------------------------------------------------------------------
# s3:// (moto's S3 server on 127.0.0.1)


def test_s3_save_is_one_put_of_the_final_key_and_reads_back(pack, s3, tmp_path):
    url = "s3://packs/one/a.kvpack"
    s3.traffic.reset()
    n = kvpack.save(pack, url, zstd_level=3, storage_options=s3.options)
    puts = [r for r in s3.traffic.requests if r[0] in ("PUT", "POST")]
    assert puts == [("PUT", "/packs/one/a.kvpack", None)]  # one whole-object put, no temporary key
    local = tmp_path / "a.kvpack"
    kvpack.save(pack, local, zstd_level=3)
    assert storage.read_bytes(url, s3.options) == local.read_bytes() and n == local.stat().st_size
    s3.traffic.reset()
    header = read_header(url, storage_options=s3.options)
    assert header.header_bytes <= s3.traffic.sent <= header.header_bytes + 64
    _same_pack(load_pack(url, storage_options=s3.options), load_pack(local))


def test_s3_load_into_a_cache_generates_like_the_local_file(pack, s3, tmp_path):
    model, tok = tiny_model("llama")
    kvpack.save(pack, "s3://packs/gen/a.kvpack", storage_options=s3.options)
    kvpack.save(pack, tmp_path / "a.kvpack")
    remote = kvpack.load("s3://packs/gen/a.kvpack", model, tokenizer=tok, storage_options=s3.options)
    local = kvpack.load(tmp_path / "a.kvpack", model, tokenizer=tok)
    question = "What is the secret code?"
    assert (kvpack.generate(model, tok, remote, question, max_new_tokens=8)
            == kvpack.generate(model, tok, local, question, max_new_tokens=8))


def test_s3_bad_credentials_and_missing_bucket_are_input_errors(s3):
    with pytest.raises(InputError, match="cannot read s3://nobucket/a.kvpack"):
        read_header("s3://nobucket/a.kvpack", storage_options=s3.options)


class _Unreachable(Exception):
    """What a backend raises that is not an OSError (as botocore's NoCredentialsError)."""


class _FailingFS(fsspec.AbstractFileSystem):
    """A backend whose every call fails with its own exception type, as s3fs without credentials does."""

    protocol = "kvpackfail"

    def _fail(self, *args, **kwargs):
        raise _Unreachable("Unable to locate credentials")

    isdir = isfile = find = size = pipe_file = _fail

    def _open(self, *args, **kwargs):
        self._fail()


def test_a_backends_own_errors_are_input_errors_not_tracebacks(tmp_path):
    fsspec.register_implementation("kvpackfail", _FailingFS, clobber=True)
    url = "kvpackfail://bucket/packs"
    for call in (lambda: storage.is_dir(url), lambda: storage.is_file(url + "/a.kvpack"),
                 lambda: storage.read_bytes(url + "/a.kvpack"), lambda: storage.file_size(url + "/a.kvpack"),
                 lambda: storage.walk_files(url, (".txt",)), lambda: storage.write_atomic(url + "/a.kvpack", b"x")):
        with pytest.raises(InputError, match="_Unreachable: Unable to locate credentials; check the URL, the "
                                             "credentials"):
            call()
    from click.testing import CliRunner

    from kvpack.cli import cli

    result = CliRunner().invoke(cli, ["ls", url])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "error: cannot reach kvpackfail://bucket/packs: _Unreachable" in result.stderr


def test_local_file_urls_in_any_spelling_are_local_paths():
    for url in ("file:///tmp/x/a.txt", "file://localhost/tmp/x/a.txt", "FILE:///tmp/x/a.txt", "local:///tmp/x/a.txt"):
        assert storage.as_path(url) == Path("/tmp/x/a.txt"), url
    deep = "[" * 50_000 + "]" * 50_000  # nested too deeply for json: kept as the string it is
    assert storage.parse_storage_options([f"k={deep}"]) == {"k": deep}
