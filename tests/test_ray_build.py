"""``kvpack build --ray``: a local Ray (2 CPUs, one cluster for the module) builds the serial build's packs, byte
for byte, under the same names, with the same manifest records, keeps going past bad contexts as the serial
build does, writes to S3 (moto on 127.0.0.1) from its actors, resumes, and reports an actor's model error as the
serial build does. Skipped when Ray is not installed."""

from __future__ import annotations

import json
import sys

import pytest

from kvpack import storage
from kvpack.errors import InputError
from kvpack.manifest import MANIFEST_NAME

from .servers import s3  # noqa: F401 (fixture)
from .test_cli import _run
from .test_storage_cli import _flags
from .tiny import TEXT, tiny_model

DOCS = {"alpha.txt": TEXT[:140], "sub/beta.md": TEXT[140:260], "empty.txt": " ", "zz.txt": TEXT * 40,
        "gamma.jsonl": json.dumps({"id": "q1", "text": TEXT[200:300]}) + "\n" + json.dumps({"text": TEXT[50:150]})}
VOLATILE = ("time",)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    model, tok = tiny_model("llama")
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    for name, text in DOCS.items():
        (root / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "docs" / name).write_text(text, encoding="utf-8")
    serial = _run(["build", str(root / "docs"), "--out", str(root / "serial"), "--model", str(root / "model"),
                   "--chunk-size", "64", "--json", "--threads", "1"], code=1)  # a CPU actor's threads: same floats
    return str(root / "model"), root / "docs", root / "serial", json.loads(serial.stdout)


def _packs(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.kvpack"))}


def _manifest(text):
    lines = text.splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE} for line in lines]


def _counts(report):
    return {k: report[k] for k in ("built", "up_to_date", "replaced", "failed")}


def test_ray_build_to_s3_matches_the_serial_build_and_resumes(ray_cluster, work, s3):
    model, docs, serial, serial_report = work
    out = "s3://packs/ray"
    args = ["build", str(docs), "--out", out, "--model", model, "--chunk-size", "64", "--json", "--ray",
            "--workers", "2", "--threads", "1", *_flags(s3.options)]
    report = json.loads(_run(args, code=1).stdout)
    assert _counts(report) == _counts(serial_report) == {"built": 4, "up_to_date": 0, "replaced": 0, "failed": 2}
    assert [(c["pack"], c["status"], c["error"]) for c in report["contexts"]] == [
        (c["pack"], c["status"], c["error"]) for c in serial_report["contexts"]]
    packs = _packs(serial)
    assert len(packs) == 4
    for name, data in packs.items():  # written by the actors, through kvpack.storage, to moto's S3
        assert storage.read_bytes(f"{out}/{name}", s3.options) == data, name
    assert _manifest(storage.read_bytes(f"{out}/{MANIFEST_NAME}", s3.options).decode()) == _manifest(
        (serial / MANIFEST_NAME).read_text(encoding="utf-8"))
    again = json.loads(_run(args, code=1).stdout)  # everything up to date: no model, no Ray actors needed
    assert _counts(again) == {"built": 0, "up_to_date": 4, "replaced": 0, "failed": 2}


def test_without_ray_the_flag_says_how_to_install_it(work, monkeypatch):
    model, docs, _, _ = work
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    from kvpack.ray_build import _import_ray

    with pytest.raises(InputError, match=r"pip install 'kvpack\[ray\]'"):
        _import_ray()
    assert "pip install 'kvpack[ray]'" in _run(["build", str(docs), "--model", model, "--ray"], code=1).output
    wrong = _run(["build", str(docs), "--model", model, "--workers", "2"], code=1)
    assert "need --ray" in wrong.output


def test_an_actor_that_cannot_load_the_model_reports_the_serial_error(ray_cluster, work, tmp_path):
    _, docs, _, _ = work
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("{}", encoding="utf-8")
    base = ["build", str(docs / "alpha.txt"), "--model", str(broken)]
    plain = _run([*base, "--out", str(tmp_path / "a")], code=1)
    with_ray = _run([*base, "--out", str(tmp_path / "b"), "--ray", "--workers", "1"], code=1)
    error = [line for line in plain.output.splitlines() if line.startswith("error:")]
    assert error and "is not supported" in error[0]
    assert [line for line in with_ray.output.splitlines() if line.startswith("error:")] == error
