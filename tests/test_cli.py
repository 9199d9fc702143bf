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
from kvpack.fileformat import load_pack

from .forge import with_float_element
from .tiny import TEXT, tiny_model

NAMES = ["alpha", "beta", "gamma/q1", "gamma/3"]


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
    assert sorted(p.relative_to(packs).as_posix() for p in packs.rglob("*.kvpack")) == sorted(
        f"{n}.kvpack" for n in NAMES)
    assert re.search(r"pack\s+tokens\s+entries kept\s+bytes\s+seconds\s+status", result.stdout)
    assert _status(result) == dict.fromkeys(NAMES, "built")
    assert "4 packs in" in result.stdout and "4 built, 0 up to date, 0 replaced; 0 failed" in result.stdout
    assert "compressing" in result.stderr  # the tqdm bar


def test_build_skips_up_to_date_packs_and_rebuilds_on_new_settings(built, models, docs, tmp_path):
    _, packs = built
    out = tmp_path / "packs"
    shutil.copytree(packs, out)
    stamps = {p.name: os.stat(p).st_mtime_ns for p in out.rglob("*.kvpack")}
    base = ["build", str(docs), "--model", models["llama"], "--device", "cpu", "--chunk-size", "64", "--out", str(out)]

    again = _run(base)
    assert _status(again) == dict.fromkeys(NAMES, "up to date")
    assert "0 built, 4 up to date" in again.stdout and "compressing" not in again.stderr
    assert {p.name: os.stat(p).st_mtime_ns for p in out.rglob("*.kvpack")} == stamps
    # the copied manifest names this model folder, so the second run did not even load the model
    assert "loading model" not in again.stderr

    assert _status(_run(base + ["--ratio", "0.5"])) == dict.fromkeys(NAMES, "replaced")
    assert _status(_run(base + ["--ratio", "0.5"])) == dict.fromkeys(NAMES, "up to date")
    assert _status(_run(base + ["--ratio", "0.5", "--overwrite"])) == dict.fromkeys(NAMES, "replaced")


def test_info_describes_the_pack(built):
    _, packs = built
    out = _run(["info", str(packs / "alpha.kvpack")]).stdout
    for pattern in (r"format\s+kvpack 1\.0, [\d,]+ bytes, tensor checksums XXH3-128", r"(?m)quantization\s+none$",
                    r"zstd\s+level 3: [\d,]+ bytes on disk, [\d,]+ decoded",
                    r"method\s+kvzip \(chunk_size=64, max_head_ratio=1.0, scoring=attention, tail_tokens=8\)", r"ratio\s+0\.3",
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
    assert res.stderr.startswith("error: ") and "XXH3-128" in res.stderr
    res = _run(["info", str(bad)])  # info reads the header and the index tensors only: the keys are verify's
    assert "entries kept per layer" in res.stdout
    head = bytearray(good.read_bytes())
    head[100] ^= 0x01  # inside the header: info refuses it
    bad.write_bytes(bytes(head))
    res = _run(["info", str(bad)], code=1)
    assert res.stderr.startswith("error: ")


def test_verify_with_another_model_names_both(built, models):
    _, packs = built
    res = _run(["verify", str(packs / "alpha.kvpack"), "--model", models["qwen2"], "--device", "cpu"], code=1)
    assert "error: " in res.stderr
    assert models["llama"] in res.stderr and models["qwen2"] in res.stderr
    assert "LlamaForCausalLM" in res.stderr and "Qwen2ForCausalLM" in res.stderr


def test_verify_and_ask_refuse_a_pack_with_nan_keys_without_a_traceback(built, models, tmp_path):
    """The format does not look at KV values, so plain ``verify`` passes; ``verify --model`` and ``ask`` refuse, as
    ``kvpack.load`` does (``tests/test_kv_range.py``)."""
    import kvpack

    _, packs = built
    pack = load_pack(packs / "alpha.kvpack")
    raw = tmp_path / "raw.kvpack"
    kvpack.save(pack, raw, zstd_level=0)
    bad = tmp_path / "nan.kvpack"  # layer 0's keys[1, 0] forged into a NaN (kvpack.save refuses to write one)
    bad.write_bytes(with_float_element(raw.read_bytes(), "keys", pack.layers[0].keys.shape[1], float("nan")))
    _run(["verify", str(bad)])
    res = _run(["verify", str(bad), "--model", models["llama"], "--device", "cpu"], code=1)
    assert "layer 0's keys hold values outside" in res.stderr
    res = _run(["ask", str(bad), "Who?", "--model", models["llama"], "--device", "cpu"], code=1)
    assert "\nerror: " in res.stderr and "layer 0's keys" in res.stderr


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
    (["--quant", "int2"], 2, "Invalid value for '--quant'"),
    (["--group-size", "16"], 2, "Invalid value for '--group-size'"),
    (["--zstd-level", "23"], 2, "Invalid value for '--zstd-level'"),
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
    assert res.stderr.startswith(f"error: no model folder or GGUF file at {str(tmp_path / 'no-model')!r}")

    other = tmp_path / "doc.pdf"
    other.write_bytes(b"%PDF")
    res = _run(["build", str(other)], code=1)
    assert "unsupported file type '.pdf'" in res.stderr
    assert "loading model" not in res.stderr


def test_missing_model_folder_is_a_clean_error(docs, tmp_path):
    res = _run(["build", str(docs), "--model", str(tmp_path / "no-model"), "--device", "cpu",
                "--out", str(tmp_path / "out")], code=1)
    assert res.stderr.splitlines()[-1].startswith("error: no model folder or GGUF file at")


def test_python_dash_m_and_version():
    res = _run(["--version"])
    assert "kvpack, version 0.1.0" in res.stdout
    proc = subprocess.run([sys.executable, "-m", "kvpack", "info", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "Usage: kvpack info" in proc.stdout


@pytest.mark.parametrize("args, params", [
    (["--method", "d2o", "--sink", "2", "--recent-ratio", "0.5", "--beta", "0.6"],
     "method\\s+d2o \\(beta=0.6, merge=keys\\+values, recent_ratio=0.5, sink=2\\)"),
    (["--method", "d2o", "--merge", "off"], "method\\s+d2o \\(beta=0.7, merge=off, recent_ratio=0.25, sink=4\\)"),
    (["--method", "d2o", "--merge", "values"], "method\\s+d2o \\(beta=0.7, merge=values, recent_ratio=0.25, sink=4\\)"),
    (["--method", "snapkv", "--window", "8", "--budget", "global"], "method\\s+snapkv \\(budget=global, .*window=8\\)"),
    (["--method", "pyramidkv", "--question", "Who?", "--beta", "5"], "method\\s+pyramidkv \\(.*beta=5.0, .*question=Who\\?"),
    (["--method", "streaming", "--sink", "0"], "method\\s+streaming \\(sink=0\\)"),
    (["--method", "random", "--seed", "3", "--budget", "layer"], "method\\s+random \\(budget=layer, seed=3\\)"),
    (["--method", "none"], "method\\s+none$"),
    (["--method", "am", "--select", "kvzip", "--values", "copy", "--queries", "64", "--on-policy"],
     "method\\s+am \\(.*on_policy=True, queries=64, queries_per_entry=8.0, query_sample=uniform, recent=16, reference=self-study\\+repeat, "
     "ridge=0.0, ridge_search=True, ridge_to=zero, .*scoring=attention, selection=kvzip, .*self_study_tokens=16, "
     ".*values=copy, weights=uniform\\)"),
    (["--method", "am", "--reference", "both", "--queries", "64", "--queries-per-entry", "2"],
     "method\\s+am \\(.*queries=64, queries_per_entry=2.0, query_sample=uniform, recent=16, reference=both, .*values=fit, weights=uniform\\)"),
    (["--method", "am", "--ridge", "0.001", "--queries", "64", "--no-ridge-search", "--reference", "repeat"],
     "method\\s+am \\(.*queries=64, queries_per_entry=8.0, query_sample=uniform, recent=16, reference=repeat, ridge=0.001, ridge_search=False, "
     "ridge_to=zero, .*selection=rms, .*values=fit, weights=uniform\\)"),
    (["--method", "am", "--reference", "prefill", "--fit-weights", "share", "--queries", "64"],
     "method\\s+am \\(.*queries=64, queries_per_entry=8.0, query_sample=uniform, recent=16, reference=prefill, .*values=fit, weights=share\\)"),
    (["--method", "am", "--queries", "64"],
     "method\\s+am \\(.*reference=self-study\\+repeat, refine_batch=512, refine_lr=0.01, refine_move=keys, refine_queries=in-window, refine_steps=30, ridge_search=True, schedule=None, score_queries=repeat, .*values=fit, "
     "weights=uniform\\)\n  unused here\\s+continue_tokens, held_out_check, max_head_ratio, ridge, "
     "ridge_to, value_bound$"),
    (["--method", "am", "--ridge", "1", "--ridge-to", "selected", "--queries", "64", "--no-ridge-search"],
     "method\\s+am \\(.*ridge=1.0, ridge_search=False, ridge_to=selected, .*values=fit, weights=uniform\\)"),
])
def test_build_with_method_options_and_info_shows_them(docs, models, tmp_path, args, params):
    out = tmp_path / "packs"
    _run(["build", str(docs / "alpha.txt"), "--model", models["llama"], "--device", "cpu", "--out", str(out), *args])
    info = _run(["info", str(out / "alpha.kvpack")]).stdout
    assert re.search(params, info, re.M), info
    # the build options that rebuild it: every method option given (none is its default here), by its flag
    flags = re.search(r"^  as build options\s+(--method \S+.*)$", info, re.M)
    assert flags and flags.group(1).split()[1] == args[1], info
    assert all(a in flags.group(1).split() for a in args[2:] if a.startswith("--")), (args, flags.group(1))
    budgets = re.search(r"^layer budgets\s+([\d, ]+) context entries", info, re.M)
    kept = re.search(r"context: ([\d,]+) of", info)
    assert budgets and sum(int(b) for b in budgets.group(1).split(", ")) == int(kept.group(1).replace(",", ""))
    assert json.loads(_run(["info", str(out / "alpha.kvpack"), "--json"]).stdout)["layer_budgets"] == [
        int(b.replace(",", "")) for b in budgets.group(1).split(", ")]
    assert ("merged " in info) == ("d2o" in args and "off" not in args)
    assert ("attention matching fit" in info) == ("am" in args)
    # --ridge-search is AM's default
    assert ("heads by validated choice (--ridge-search)" in info) == ("am" in args and "--no-ridge-search" not in args)
    if "am" in args:  # info --json has the fit statistics the text shows
        fit = json.loads(_run(["info", str(out / "alpha.kvpack"), "--json"]).stdout)["fit"]
        block = info.split("attention matching fit", 1)[1].split("\n\n", 1)[0]
        layers = re.findall(r"^\s+\d+\s+\S+\s+\S+\s+\S+$", block, re.M)
        assert fit and len(fit["relative_error"]) == len(layers) > 0
        assert (fit["ridge_search"] is not None) == ("--no-ridge-search" not in args)
        assert fit["queries"] > 0 and fit["held_out"] > 0
    # info --json carries the same build options as the text, and the model fingerprint's digests
    described = json.loads(_run(["info", str(out / "alpha.kvpack"), "--json"]).stdout)
    assert described["build_options"] == flags.group(1)
    unused = re.search(r"^  unused here\s+(.*)$", info, re.M)
    assert described["unused_params"] == (unused.group(1).split(", ") if unused else [])
    assert sum(described["bytes_by_section"].values()) == described["bytes"]
    for name in ("tokenizer", "weights"):
        digest = re.search(rf"^  {name}\s+sha256 ([0-9a-f]+)\.\.\.", info, re.M)
        assert digest and len(described[f"{name}_sha256"]) == 64
        assert described[f"{name}_sha256"].startswith(digest.group(1))
    if "both" in args:  # kvpack ls names the options that differ from the method's defaults
        listing = _run(["ls", str(out)]).stdout
        assert re.search(r"alpha\.kvpack\s+alpha\.txt\s+am\[queries=64;queries_per_entry=2\.0;reference=both\]\s+"
                         r"[\d.]+\s+none\s", listing), listing


def test_method_label_names_changed_parameters_and_survives_hostile_headers():
    from kvpack.listing import method_label
    from kvpack.methods import get_method

    assert method_label("am", get_method("am", reference="both").params()) == "am[reference=both]"
    assert method_label("am", get_method("am").params()) == "am"
    assert method_label("am", get_method("am", on_policy=True).params()) == "am[on_policy=true]"
    assert method_label("d2o", get_method("d2o", merge="off", sink=2).params()) == "d2o[merge=off;sink=2]"
    assert method_label("kvzip", {}) == "kvzip" and method_label("none", None) == "none"
    assert method_label("kvzip", get_method("kvzip", chunk_size=64).params()) == "kvzip"  # a build setting
    assert method_label(["am"], {}) == "?" and method_label("", {"a": 1}) == "?"
    assert method_label("not-a-method", {"a": 1}) == "not-a-method"
    assert method_label("am", {"reference": ["both"], 3: 4, "queries": {"x": 1}}) == "am"
    assert method_label("am", {"reference": "both\x1b[31m\nX"}) == "am"  # no control characters in the table
    assert method_label("am", {"on_policy": 0}) == "am[on_policy=0]"  # not the default False


def test_build_flags_give_the_build_options_that_rebuild_a_pack():
    """``kvpack info``'s "as build options": changed parameters as their flags (a boolean as --x or --no-x), the
    API-only ones named apart, a parameter the pack does not record read as a build reads it (an AM pack from before
    the twenty-sixth session's defaults shows the earlier ones), and nothing from a hostile header."""
    from kvpack.listing import build_flags
    from kvpack.methods import get_method

    assert build_flags("am", get_method("am").params()) == "--method am"
    assert build_flags("am", get_method("am", selection="kvzip", ridge_search=False, queries=4096,
                                        held_out_check=False).params()) == (
        "--method am --queries 4096 --no-ridge-search --select kvzip (no flag: held_out_check=false)")
    assert build_flags("am", get_method("am", on_policy=True, weights="share").params()) == (
        "--method am --on-policy --fit-weights share")
    assert build_flags("d2o", get_method("d2o", merge="off", sink=2).params()) == "--method d2o --merge off --sink 2"
    old = {k: v for k, v in get_method("am").params().items()
           if k not in ("selection", "reference", "queries", "queries_per_entry", "self_study_tokens", "ridge_search")}
    assert build_flags("am", old) == ("--method am --queries 4096 --queries-per-entry 2.0 --reference repeat "
                                      "--no-ridge-search --select kvzip")  # no self-study: its tokens unused
    # a parameter the others make inert is no build option (the cap of an uncapped split)
    assert build_flags("am", get_method("am", max_head_ratio=0.5).params()) == "--method am"
    assert build_flags("am", get_method("am", budgets="global-capped", max_head_ratio=0.5).params()) == (
        "--method am --budgets global-capped --max-head-ratio 0.5")
    assert build_flags("kvzip", {}) == "--method kvzip"
    assert build_flags("not-a-method", {}) is None and build_flags("am", [1]) is None and build_flags(3, {}) is None
    assert build_flags("kvzip", {"max_head_ratio": "0.5\x1b[2J"}) == "--method kvzip"  # no control characters


@pytest.mark.parametrize("args, message", [
    (["--method", "h2o", "--sink", "3"], "error: --method h2o does not take --sink (its options: --budget)"),
    (["--method", "kvzip", "--merge", "off"], "error: --method kvzip does not take --merge"),
    (["--method", "none", "--window", "4"], "it has no method options"),
    (["--method", "pyramidkv", "--budget", "global"], "error: pyramidkv: budget must be one of layer, head"),
    (["--method", "d2o", "--beta", "2"], "error: d2o: beta must be a number in [0.0, 1.0]"),
    (["--method", "kvzip", "--values", "fit"], "error: --method kvzip does not take --values"),
    (["--method", "kvzip", "--ridge", "0.01"], "error: --method kvzip does not take --ridge"),
    (["--method", "am", "--ridge-to", "selected"], "error: am: --ridge-to selected (ridge_to='selected') shrinks"),
])
def test_build_refuses_options_the_method_does_not_take(docs, models, tmp_path, args, message):
    res = _run(["build", str(docs / "alpha.txt"), "--model", models["llama"], "--device", "cpu",
                "--out", str(tmp_path / "out"), *args], code=1)
    assert message in res.stderr
    assert not (tmp_path / "out" / "alpha.kvpack").exists()


def test_build_quantized_packs_and_info_shows_quantization_and_errors(models, tmp_path, monkeypatch):
    out = tmp_path / "packs"
    (tmp_path / "alpha.txt").write_text(TEXT * 3, encoding="utf-8")  # long enough for several groups per head
    base = ["build", str(tmp_path / "alpha.txt"), "--model", models["llama"], "--device", "cpu", "--chunk-size",
            "64", "--ratio", "1.0", "--out", str(out)]
    _run(base + ["--zstd-level", "0", "--checksum", "sha256"])
    info = _run(["info", str(out / "alpha.kvpack")]).stdout
    assert re.search(r"format\s+kvpack 1\.0, [\d,]+ bytes, tensor checksums SHA-256", info)
    assert _status(_run(base + ["--zstd-level", "0"])) == {"alpha": "replaced"}  # another checksum: rebuilt
    plain = (out / "alpha.kvpack").stat().st_size
    info = _run(["info", str(out / "alpha.kvpack")]).stdout
    assert re.search(r"format\s+kvpack 1\.0, [\d,]+ bytes, tensor checksums XXH3-128", info)
    assert re.search(r"zstd\s+off$", info, re.M) and "quantization error per layer" not in info

    assert _status(_run(base + ["--quant", "int4"])) == {"alpha": "replaced"}  # quantization is a new setting
    assert _status(_run(base + ["--quant", "int4"])) == {"alpha": "up to date"}
    assert _status(_run(base + ["--quant", "int4", "--group-size", "64"])) == {"alpha": "replaced"}
    assert _status(_run(base + ["--quant", "int4", "--group-size", "64", "--zstd-level", "5"])) == {
        "alpha": "replaced"}
    assert (out / "alpha.kvpack").stat().st_size < plain / 3
    assert re.search(r"^alpha\.kvpack\s+alpha\.txt\s+kvzip\s+[\d.]+\s+int4\s", _run(["ls", str(out)]).stdout, re.M)
    info = _run(["info", str(out / "alpha.kvpack")]).stdout
    assert re.search(r"format\s+kvpack 1\.0, ", info) and re.search(r"zstd\s+level 5: ", info)
    assert re.search(r"quantization\s+int4, group size 64, compact layout \(key code widths ", info)
    rows = re.findall(r"^\s+(\d)\s+([\d.e-]+)\s+([\d.e-]+)\s+([\d.e-]+)\s+([\d.e-]+)\s+([\d.]+)%$", info, re.M)
    assert [r[0] for r in rows] == ["0", "1"], info
    assert all(float(r[1]) >= float(r[2]) > 0 and float(r[5]) > 0 for r in rows)
    sections = dict(re.findall(r"^\s+(\w+)\s+([\d,]+)\s+[\d.]+%$", info, re.M))
    assert sections.pop("total") == f"{(out / 'alpha.kvpack').stat().st_size:,}"
    assert {"key_codes", "key_bits", "key_params", "value_codes", "value_params", "quant_grid"} <= set(sections)
    assert sum(int(v.replace(",", "")) for v in sections.values()) == (out / "alpha.kvpack").stat().st_size
    res = _run(["ask", str(out / "alpha.kvpack"), "What is the secret code of Alice?", "--model", models["llama"],
                "--device", "cpu", "--max-new-tokens", "4"])
    assert res.stdout.endswith("\n")
    from kvpack import kernels
    from kvpack.compact_cache import CompactLayer

    monkeypatch.setattr(kernels, "INTERPRETED", False)  # the exact per-call path on CPU, even under the interpreter
    made = []
    init = CompactLayer.__init__
    monkeypatch.setattr(CompactLayer, "__init__", lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    fly = _run(["ask", str(out / "alpha.kvpack"), "What is the secret code of Alice?", "--model", models["llama"],
                "--device", "cpu", "--max-new-tokens", "4", "--dequantize", "on-the-fly"])
    assert made and fly.stdout == res.stdout  # the codes kept in memory answer as the dequantized rows do
    # SHA-256 checksums: the same compact layout; another checksum rebuilds
    assert _status(_run(base + ["--quant", "int4", "--checksum", "sha256"])) == {"alpha": "replaced"}
    info = _run(["info", str(out / "alpha.kvpack")]).stdout
    assert re.search(r"tensor checksums SHA-256", info) and re.search(r"int4, group size 32, compact layout", info)


def test_int4_build_fits_a_16_dim_head(docs, models, tmp_path):
    res = _run(["build", str(docs / "alpha.txt"), "--model", models["qwen2"], "--device", "cpu", "--quant", "int4",
                "--group-size", "128", "--out", str(tmp_path / "out")])  # values: groups of min(128, 16) channels
    assert "1 built" in res.stdout


def test_build_help_shows_each_method_options_default_booleans_as_their_flag():
    text = re.sub(r"-\s+", "-", " ".join(_run(["build", "--help"]).stdout.split()))  # the help's wrapping undone
    assert "[default: --ridge-search]" in text and "[default: --no-on-policy]" in text
    assert "[default: 8192; 16<=x<=50000]" in text and "[default: self-study+repeat]" in text
    assert "[default: rms]" in text and "[default: 16; x>=0]" in text  # --recent


def test_fit_summary_checks_every_field_of_a_hostile_header():
    from kvpack.listing import fit_summary

    fit = {"relative_error": [0.1, None, float("nan"), 10**400, True, "x"], "queries": 3840, "held_out": True,
           "heads_unfitted": -1, "heads_rejected_by": {"value_bound": 2, 3: "x"}, "ridge_search": ["selection"]}
    got = fit_summary({"fit": fit})
    assert got["relative_error"] == [0.1, None, None, None, None, None] and got["selection_error"] is None
    assert got["queries"] == 3840 and got["held_out"] is None and got["heads_unfitted"] is None
    assert got["heads_rejected_by"] == {"value_bound": 2, "3": None} and got["ridge_search"] is None
    for hostile in (None, "x", {"fit": None}, {"fit": {"relative_error": "x"}}, {"fit": []}):
        assert fit_summary(hostile) is None
    json.dumps(got, allow_nan=False)  # strict JSON
