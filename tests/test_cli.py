"""The ``kvpack`` command line, driven through click's CliRunner with tiny models saved to folders."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvpack.cli import cli

from .tiny import TEXT, tiny_model

NAMES = ["alpha", "beta", "gamma-q1", "gamma-3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Folders holding the tiny llama and qwen2 models with their tokenizer."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("llama", "qwen2"):
        model, tok = tiny_model(arch)
        model.save_pretrained(root / arch)
        tok.save_pretrained(root / arch)
        out[arch] = str(root / arch)
    return out


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """A folder with a .txt, a .md and a two-line .jsonl (one line with an id, one without)."""
    folder = tmp_path_factory.mktemp("work") / "docs"
    folder.mkdir()
    (folder / "alpha.txt").write_text(TEXT[:160], encoding="utf-8")
    (folder / "beta.md").write_text("# Log\n" + TEXT[150:280], encoding="utf-8")
    (folder / "gamma.jsonl").write_text(
        json.dumps({"id": "q1", "text": TEXT[200:330]}) + "\n\n" + json.dumps({"text": TEXT[:120]}) + "\n",
        encoding="utf-8")
    (folder / "ignored.csv").write_text("a,b\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def built(models, docs):
    """``kvpack build docs --model llama``: the result and the packs folder (the default --out)."""
    result = _run(["build", str(docs), "--model", models["llama"], "--device", "cpu", "--chunk-size", "64"])
    return result, docs.parent / "packs"


def _run(args, code=0):
    result = CliRunner().invoke(cli, args)
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == code, result.output
    return result


def _status(result):
    """context name -> status, from the summary table."""
    rows = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in NAMES:
            rows[parts[0]] = " ".join(parts[5:])
    return rows


def test_build_writes_one_pack_per_context_and_prints_a_summary(built):
    result, packs = built
    assert sorted(p.name for p in packs.iterdir()) == sorted(f"{n}.kvpack" for n in NAMES)
    assert re.search(r"context\s+tokens\s+entries kept\s+bytes\s+seconds\s+status", result.stdout)
    assert _status(result) == dict.fromkeys(NAMES, "built")
    assert "4 packs in" in result.stdout and "4 built, 0 skipped" in result.stdout
    assert "compressing" in result.stderr  # the tqdm bar


def test_build_skips_up_to_date_packs_and_rebuilds_on_new_settings(built, models, docs, tmp_path):
    _, packs = built
    out = tmp_path / "packs"
    shutil.copytree(packs, out)
    stamps = {p.name: os.stat(p).st_mtime_ns for p in out.iterdir()}
    base = ["build", str(docs), "--model", models["llama"], "--device", "cpu", "--chunk-size", "64", "--out", str(out)]

    again = _run(base)
    assert _status(again) == dict.fromkeys(NAMES, "skipped (up to date)")
    assert "0 built, 4 skipped" in again.stdout and "compressing" not in again.stderr
    assert {p.name: os.stat(p).st_mtime_ns for p in out.iterdir()} == stamps

    assert _status(_run(base + ["--ratio", "0.5"])) == dict.fromkeys(NAMES, "built")
    assert _status(_run(base + ["--ratio", "0.5"])) == dict.fromkeys(NAMES, "skipped (up to date)")
    assert _status(_run(base + ["--ratio", "0.5", "--overwrite"])) == dict.fromkeys(NAMES, "built")


def test_info_describes_the_pack(built):
    _, packs = built
    out = _run(["info", str(packs / "alpha.kvpack")]).stdout
    for pattern in (r"format\s+kvpack v1", r"method\s+kvzip \(chunk_size=64, tail_tokens=8\)", r"ratio\s+0\.3",
                    r"architecture\s+LlamaForCausalLM", r"heads\s+4 query, 2 KV", r"head dim\s+16",
                    r"tokens\s+\d+ \(\d+ sink \+ \d+ context\)", r"source\s+alpha\.txt \(sha256 [0-9a-f]{12}",
                    r"weights\s+sha256 [0-9a-f]{12}\.\.\.", r"kvpack version\s+0\.1\.0"):
        assert re.search(pattern, out), pattern
    layer_rows = re.findall(r"^\s+(\d)\s+compressed\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\d+)$", out, re.M)
    assert [r[0] for r in layer_rows] == ["0", "1"]
    for _, total, lo, mean, hi in layer_rows:
        assert int(lo) <= float(mean) <= int(hi) and abs(float(mean) * 2 - int(total)) < 0.2  # 2 KV heads
    sections = dict(re.findall(r"^\s+(header|token_ids|head_lengths|keys|values|positions)\s+([\d,]+)", out, re.M))
    total = int(re.search(r"^\s+total\s+([\d,]+)", out, re.M).group(1).replace(",", ""))
    assert sum(int(v.replace(",", "")) for v in sections.values()) == total == (packs / "alpha.kvpack").stat().st_size


def test_verify_accepts_a_good_file_and_rejects_a_bit_flip(built, models, tmp_path):
    _, packs = built
    good = packs / "beta.kvpack"
    assert _run(["verify", str(good)]).stdout.startswith(f"OK: {good} is intact")
    res = _run(["verify", str(good), "--model", models["llama"], "--device", "cpu"])
    assert "fits model" in res.stdout

    bad = tmp_path / "beta.kvpack"
    data = bytearray(good.read_bytes())
    data[len(data) // 2 + 100] ^= 0x01
    bad.write_bytes(bytes(data))
    res = _run(["verify", str(bad)], code=1)
    assert res.stderr.startswith("error: ") and "SHA-256" in res.stderr
    res = _run(["info", str(bad)], code=1)
    assert res.stderr.startswith("error: ")


def test_verify_with_another_model_names_both(built, models):
    _, packs = built
    res = _run(["verify", str(packs / "alpha.kvpack"), "--model", models["qwen2"], "--device", "cpu"], code=1)
    assert "error: " in res.stderr
    assert models["llama"] in res.stderr and models["qwen2"] in res.stderr
    assert "LlamaForCausalLM" in res.stderr and "Qwen2ForCausalLM" in res.stderr


def test_ask_prints_an_answer(built, models):
    _, packs = built
    res = _run(["ask", str(packs / "alpha.kvpack"), "What is the secret code of Alice?", "--model", models["llama"],
                "--device", "cpu", "--max-new-tokens", "4"])
    assert res.stdout.endswith("\n")  # the model is random: any answer will do
    res = _run(["ask", str(packs / "alpha.kvpack"), "Code?", "--model", models["qwen2"], "--device", "cpu"], code=1)
    assert "was built for model" in res.stderr


@pytest.mark.parametrize("args, code, message", [
    (["--ratio", "1.5"], 2, "Invalid value for '--ratio'"),
    (["--method", "nope"], 2, "Invalid value for '--method'"),
    (["--chunk-size", "0"], 2, "Invalid value for '--chunk-size'"),
])
def test_build_rejects_bad_options(docs, models, args, code, message):
    res = _run(["build", str(docs), "--model", models["llama"], *args], code=code)
    assert message in res.stderr


def test_build_rejects_bad_inputs_before_loading_the_model(tmp_path):
    missing = tmp_path / "missing"
    res = _run(["build", str(missing), "--model", str(tmp_path / "no-model")], code=1)
    assert res.stderr == f"error: {missing}: no such file or folder; check the path\n"

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "oops"}\n', encoding="utf-8")
    res = _run(["build", str(bad), "--model", str(tmp_path / "no-model")], code=1)
    assert res.stderr.startswith(f"error: {bad}:2: no string \"text\" field")

    other = tmp_path / "doc.pdf"
    other.write_bytes(b"%PDF")
    res = _run(["build", str(other)], code=1)
    assert "unsupported file type '.pdf'" in res.stderr
    assert "loading model" not in res.stderr


def test_missing_model_folder_is_a_clean_error(docs, tmp_path):
    res = _run(["build", str(docs), "--model", str(tmp_path / "no-model"), "--device", "cpu",
                "--out", str(tmp_path / "out")], code=1)
    assert res.stderr.splitlines()[-1].startswith("error: could not load model")


def test_python_dash_m_and_version():
    res = _run(["--version"])
    assert "kvpack, version 0.1.0" in res.stdout
    proc = subprocess.run([sys.executable, "-m", "kvpack", "info", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "Usage: kvpack info" in proc.stdout
