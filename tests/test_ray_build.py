"""``kvpack build --ray``: a local Ray (2 CPUs, one cluster for the module) builds the serial build's packs, byte
for byte, under the same names, with the same manifest records, keeps going past bad contexts as the serial
build does, and resumes. Skipped when Ray is not installed."""

from __future__ import annotations

import json
import sys

import pytest

from kvpack.errors import InputError
from kvpack.manifest import MANIFEST_NAME

from .test_cli import _run
from .tiny import TEXT, tiny_model

DOCS = {"alpha.txt": TEXT[:140], "sub/beta.md": TEXT[140:260], "empty.txt": " ", "zz.txt": TEXT * 40,
        "gamma.jsonl": json.dumps({"id": "q1", "text": TEXT[200:300]}) + "\n" + json.dumps({"text": TEXT[50:150]})}
VOLATILE = ("time",)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
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
                   "--chunk-size", "64", "--json"], code=1)
    return str(root / "model"), root / "docs", root / "serial", json.loads(serial.stdout)


def _packs(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.kvpack"))}


def _manifest(folder):
    lines = (folder / MANIFEST_NAME).read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE} for line in lines]


def _counts(report):
    return {k: report[k] for k in ("built", "up_to_date", "replaced", "failed")}


def test_ray_build_matches_the_serial_build_and_resumes(ray_cluster, work, tmp_path):
    model, docs, serial, serial_report = work
    out = tmp_path / "ray"
    args = ["build", str(docs), "--out", str(out), "--model", model, "--chunk-size", "64", "--json", "--ray",
            "--workers", "2"]
    report = json.loads(_run(args, code=1).stdout)
    assert _counts(report) == _counts(serial_report) == {"built": 4, "up_to_date": 0, "replaced": 0, "failed": 2}
    assert [(c["pack"], c["status"], c["error"]) for c in report["contexts"]] == [
        (c["pack"], c["status"], c["error"]) for c in serial_report["contexts"]]
    assert _packs(out) == _packs(serial) and len(_packs(out)) == 4
    assert _manifest(out) == _manifest(serial)
    again = json.loads(_run(args, code=1).stdout)  # everything up to date: no model, no Ray actors needed
    assert _counts(again) == {"built": 0, "up_to_date": 4, "replaced": 0, "failed": 2}


def test_without_ray_the_flag_says_how_to_install_it(work, monkeypatch):
    model, docs, _, _ = work
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    from kvpack.ray_build import _import_ray

    with pytest.raises(InputError, match=r"pip install 'kvpack\[ray\]'"):
        _import_ray()
    wrong = _run(["build", str(docs), "--model", model, "--workers", "2"], code=1)
    assert "need --ray" in wrong.output
