"""``kvpack build`` on document trees through the CLI (mirrored names, keep going, summaries, exit codes, Ctrl-C,
checks before the model loads), ``ls``, several files for ``info``/``verify``, ``ask`` with several questions, and
``--model`` errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import kvpack.build
from kvpack.cli import cli
from kvpack.errors import InputError
from kvpack.listing import list_packs
from kvpack.manifest import read_manifest

from .tiny import TEXT, tiny_config, tiny_model, tiny_tokenizer


def _run(args, code=0, input=None, env=None):
    result = CliRunner().invoke(cli, args, input=input, env=env)
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == code, result.output
    return result


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "llama"
    model, tok = tiny_model("llama")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def short_llama(tmp_path_factory):
    """The tiny llama architecture with max_position_embeddings 456: contexts of at most 200 tokens."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("models") / "short"
    tok = tiny_tokenizer()
    cfg = tiny_config("llama", len(tok))
    cfg.max_position_embeddings = 456
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _tree(root):
    docs = root / "docs"
    files = {"0-empty.txt": "", "a/notes.txt": TEXT[:120], "b/notes.txt": TEXT[100:220], "m-long.txt": TEXT * 60,
             "n-bin.txt": None, "文档.txt": TEXT[:90], "报告.txt": TEXT[50:150], "résumé.md": TEXT[20:140]}
    for rel, text in files.items():
        (docs / rel).parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            (docs / rel).write_bytes(b"\x89PNG\x00\x01")
        else:
            (docs / rel).write_text(text, encoding="utf-8")
    (docs / "q.jsonl").write_text(json.dumps({"id": "x/1", "text": TEXT[:80]}) + "\n"
                                  + json.dumps({"id": "x/1", "text": TEXT[80:160]}) + "\n", encoding="utf-8")
    return docs


def test_build_a_real_tree_keeps_going_mirrors_names_and_exits_1(llama, tmp_path):
    docs = _tree(tmp_path)
    out = tmp_path / "out"
    base = ["build", str(docs), "--model", llama, "--device", "cpu", "--chunk-size", "64", "--out", str(out)]
    res = _run(base, code=1)
    built = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.kvpack"))
    assert built == sorted(["a/notes.kvpack", "b/notes.kvpack", "文档.kvpack", "报告.kvpack", "résumé.kvpack",
                            "q/x_1.kvpack", "q/x_1-2.kvpack"])
    lines = res.stdout.splitlines()
    assert "failed: 0-empty.txt: the file is empty; remove it or give it some text" in lines
    assert any(l.startswith("failed: m-long.txt: ") and "too long for this model (at most 3,840)" in l
               and "--split" in l for l in lines)
    assert any(l.startswith("failed: n-bin.txt: not text: it holds NUL bytes") for l in lines)
    assert lines[-1].startswith(f"7 packs in {out}: 7 built, 0 up to date, 0 replaced; 3 failed; ")  # 7 files
    assert "文档" in res.stderr  # the bar names the context being built
    records = read_manifest(out)
    assert records["m-long.kvpack"]["status"] == "failed" and records["a/notes.kvpack"]["status"] == "built"

    again = _run(base + ["--json"], code=1)
    summary = json.loads(again.stdout)
    assert (summary["built"], summary["up_to_date"], summary["replaced"], summary["failed"]) == (0, 7, 0, 3)
    assert "loading model" not in again.stderr  # nothing to build: the model is not loaded
    by_pack = {c["pack"]: c for c in summary["contexts"]}
    assert by_pack["q/x_1-2.kvpack"]["source"] == "q.jsonl" and by_pack["q/x_1-2.kvpack"]["line"] == 2
    assert by_pack["0-empty.kvpack"]["error"].startswith("the file is empty")
    assert by_pack["m-long.kvpack"]["tokens"] == records["m-long.kvpack"]["tokens"] > 3840  # as when it first failed

    (docs / "a" / "notes.txt").write_text(TEXT[:130], encoding="utf-8")
    third = json.loads(_run(base + ["--json"], code=1).stdout)
    assert {c["pack"]: c["status"] for c in third["contexts"]}["a/notes.kvpack"] == "replaced"

    fast = _run(base + ["--fail-fast", "--out", str(tmp_path / "fast")], code=1)
    assert fast.stdout.splitlines()[-1].startswith("0 packs in") and not list((tmp_path / "fast").rglob("*.kvpack"))


def test_build_checks_out_and_model_before_loading_it(llama, tmp_path):
    (tmp_path / "d.txt").write_text(TEXT[:100], encoding="utf-8")
    (tmp_path / "file").write_text("x", encoding="utf-8")
    res = _run(["build", str(tmp_path / "d.txt"), "--model", llama, "--out", str(tmp_path / "file")], code=2)
    assert f"Invalid value for '--out': Directory '{tmp_path / 'file'}' is a file" in res.stderr
    res = _run(["build", str(tmp_path / "d.txt"), "--model", llama, "--out", str(tmp_path / "file" / "sub")], code=1)
    assert res.stderr.startswith(f"error: cannot create the output folder {tmp_path / 'file' / 'sub'}")
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    res = _run(["build", str(tmp_path / "d.txt"), "--model", str(empty)], code=1)
    assert res.stderr == (f"error: {str(empty)!r} is a folder but holds no config.json (nor a .gguf file), so it is "
                          "not a model folder; pass the folder that holds config.json, the weights and the "
                          "tokenizer, a GGUF file (or kvpack-reference for the embedded model)\n")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}), encoding="utf-8")
    res = _run(["build", str(tmp_path / "d.txt"), "--model", str(gpt2), "--out", str(tmp_path / "o")], code=1)
    assert res.stderr.startswith("error: model type 'gpt2' (config.json) is not supported; kvpack supports llama, "
                                 "mistral, qwen2, qwen3, phi3, gemma3_text")
    for r in (res,):
        assert "loading model" not in r.stderr and len(r.stderr.splitlines()) == 1
    res = _run(["build", str(tmp_path / "d.txt"), "--model", "someorg/somemodel", "--out", str(tmp_path / "o")],
               code=1, env={"HF_HUB_OFFLINE": "1"})
    assert res.stderr.splitlines()[-1].startswith("error: could not load model 'someorg/somemodel'")
    assert "not in the local Hugging Face cache and the hub is not reachable (offline)" in res.stderr


def test_build_split_interrupt_and_threads(short_llama, tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    text = "".join(f"Paragraph {i}. {TEXT[:150]}\n\n" for i in range(5))
    (docs / "long.txt").write_text(text, encoding="utf-8")
    (docs / "short.txt").write_text(TEXT[:100], encoding="utf-8")
    base = ["build", str(docs), "--model", short_llama, "--device", "cpu", "--chunk-size", "64"]
    before = torch.get_num_threads()
    try:
        res = _run(base + ["--split", "--threads", "1", "--out", str(tmp_path / "split")])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    parts = sorted(p.name for p in (tmp_path / "split").glob("long.part-*.kvpack"))
    assert len(parts) >= 2 and parts[0] == "long.part-001.kvpack"
    assert f"{len(parts) + 1} built" in res.stdout

    real = kvpack.build.compress
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(kvpack.build, "compress", interrupted)
    out = tmp_path / "int"
    res = _run(base + ["--out", str(out)] + ["--split"], code=130)
    assert re.search(r"1 pack in .*: 1 built, .*; interrupted$", res.stdout.splitlines()[-1])
    assert "interrupted: the packs listed are written; run the same command again to resume" in res.stderr
    monkeypatch.setattr(kvpack.build, "compress", real)
    statuses = json.loads(_run(base + ["--out", str(out), "--split", "--json"]).stdout)
    assert statuses["up_to_date"] == 1 and statuses["built"] == len(parts)


def test_ls_info_and_verify_take_folders_and_several_files(llama, tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text(TEXT[:100], encoding="utf-8")
    (docs / "sub" / "b.md").write_text(TEXT[100:200], encoding="utf-8")
    out = tmp_path / "packs"
    _run(["build", str(docs), "--model", llama, "--device", "cpu", "--chunk-size", "64", "--out", str(out)])
    (out / "junk.kvpack").write_bytes(b"not a pack at all")
    res = _run(["ls", str(out)], code=1)  # listed, and the exit status says one is unreadable
    assert re.search(r"^pack\s+source\s+method\s+ratio\s+quant\s+tokens\s+bytes\s+model$", res.stdout, re.M)
    assert re.search(rf"^a\.kvpack\s+a\.txt\s+kvzip\s+0\.3\s+none\s+\d+\s+[\d,]+\s+{re.escape(llama)}$", res.stdout,
                     re.M)
    assert re.search(r"^sub/b\.kvpack\s+sub/b\.md\s+kvzip", res.stdout, re.M)
    assert re.search(r"^junk\.kvpack\s+unreadable \(below\)\s*$", res.stdout, re.M)
    assert re.search(r"^unreadable: junk\.kvpack: .*not a kvpack file", res.stderr, re.M)
    good = (out / "a.kvpack").stat().st_size + (out / "sub" / "b.kvpack").stat().st_size
    assert res.stdout.rstrip().endswith(f"3 packs in {out}, {good:,} bytes; 1 unreadable")
    assert max(map(len, res.stdout.splitlines()[:4])) < 200  # the error is not a table column
    assert "no such folder" in _run(["ls", str(tmp_path / "missing")], code=1).stderr
    with pytest.raises(InputError, match="is a file, not a folder"):  # the CLI's argument parser refuses it first
        list_packs(out / "a.kvpack")
    rows = [json.loads(l) for l in _run(["ls", str(out), "--json"], code=1).stdout.splitlines()]  # JSON Lines
    assert [r["pack"] for r in rows] == ["a.kvpack", "junk.kvpack", "sub/b.kvpack"]
    assert rows[0]["bytes"] == (out / "a.kvpack").stat().st_size and rows[0]["model"] == llama
    assert rows[1]["error"] and rows[2]["source"]["name"] == "sub/b.md"

    info = [json.loads(l) for l in _run(["info", str(out / "a.kvpack"), str(out / "sub" / "b.kvpack"), "--json"]
                                        ).stdout.splitlines()]
    assert [i["source"]["name"] for i in info] == ["a.txt", "sub/b.md"] and info[0]["method"] == "kvzip"
    assert info[0]["fit"] is None  # Attention Matching's fit statistics only
    text = _run(["info", str(out / "a.kvpack"), str(out / "junk.kvpack")], code=1)
    assert f"== {out / 'a.kvpack'}" in text.stdout and text.stderr.startswith("error: ")
    res = _run(["verify", str(out / "a.kvpack"), str(out / "junk.kvpack"), "--json"], code=1)
    reports = [json.loads(l) for l in res.stdout.splitlines()]
    assert [r["ok"] for r in reports] == [True, False] and reports[1]["error"]
    res = _run(["verify", str(out), "--json"], code=1)  # a folder: its packs, recursively, in path order
    assert [(Path(r["file"]).relative_to(out).as_posix(), r["ok"]) for r in map(json.loads, res.stdout.splitlines())
            ] == [("a.kvpack", True), ("junk.kvpack", False), ("sub/b.kvpack", True)]
    assert str(out / "sub" / "b.kvpack") in _run(["info", str(out / "sub")]).stdout
    (tmp_path / "empty").mkdir()
    assert "no .kvpack file in this folder" in _run(["verify", str(tmp_path / "empty")], code=1).stderr
    res = _run(["verify", str(out / "a.kvpack"), str(out / "sub" / "b.kvpack"), "--model", llama, "--device", "cpu"])
    assert res.stdout.count("is intact") == 2 and res.stdout.count("fits model") == 2


def test_ask_answers_several_questions_from_one_load(llama, tmp_path):
    (tmp_path / "d.txt").write_text(TEXT, encoding="utf-8")
    _run(["build", str(tmp_path / "d.txt"), "--model", llama, "--device", "cpu", "--chunk-size", "64",
          "--out", str(tmp_path / "p")])
    pack = str(tmp_path / "p" / "d.kvpack")
    common = ["--model", llama, "--device", "cpu", "--max-new-tokens", "5"]
    one = _run(["ask", pack, "What is the secret code of Alice?", *common]).stdout
    res = _run(["ask", pack, "What is the secret code of Alice?", "-", *common, "--json"],
               input="When did the storm come?\n\nWhat arrived by boat?\n")
    answers = [json.loads(l) for l in res.stdout.splitlines()]
    assert [a["question"] for a in answers] == ["What is the secret code of Alice?", "When did the storm come?",
                                                "What arrived by boat?"]
    assert answers[0]["answer"] == one.strip()  # greedy: the same answer from a shared cache
    assert all(1 <= a["tokens"] <= 5 and a["tokens_per_second"] > 0 and a["load_seconds"] > 0 for a in answers)
    assert res.stderr.count("loading model") == 1
    text = _run(["ask", pack, "What is the secret code of Alice?", "When did the storm come?", *common]).stdout
    assert text.splitlines()[:2] == ["Q: What is the secret code of Alice?", f"A: {one.strip()}"]
    sampled = [_run(["ask", pack, "Who?", *common, "--temperature", "1.5", "--seed", str(s)]).stdout for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]
    res = _run(["ask", pack, "Who?", "--device", "cpu"], code=1)  # built with another model than the embedded one
    assert res.stderr == (f"error: {pack} was built with model {llama!r}, not the embedded reference model; pass "
                          "--model with that model's folder (or hub id)\n")


def test_embedded_model_is_named_kvpack_reference_and_used_by_ask(tmp_path):
    (tmp_path / "d.txt").write_text("The secret code of Maria is 73914. " * 3, encoding="utf-8")
    _run(["build", str(tmp_path / "d.txt"), "--model", "kvpack-reference", "--out", str(tmp_path / "p")])
    rows = [json.loads(l) for l in _run(["ls", str(tmp_path / "p"), "--json"]).stdout.splitlines()]
    assert rows[0]["model"] == "kvpack-reference"
    res = _run(["ask", str(tmp_path / "p" / "d.kvpack"), "What is the secret code of Maria?", "--max-new-tokens",
                "24"])
    assert "73914" in res.stdout


def test_a_dtype_mismatch_says_which_dtypes_differ(llama, tmp_path):
    (tmp_path / "d.txt").write_text(TEXT[:150], encoding="utf-8")
    _run(["build", str(tmp_path / "d.txt"), "--model", llama, "--device", "cpu", "--dtype", "float16",
          "--chunk-size", "64", "--out", str(tmp_path / "p")])
    res = _run(["verify", str(tmp_path / "p" / "d.kvpack"), "--model", llama, "--device", "cpu", "--dtype",
                "bfloat16"], code=1)
    assert "was built with the model in float16 but the model given is loaded in bfloat16; the dtypes differ" \
        in res.stderr
    assert "`--dtype float16`" in res.stderr and "weights differ" not in res.stderr


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default. A test run started in the background by a
    non-interactive shell (``cmd &``) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    handler, so the child would never see the Ctrl-C this test sends."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_prints_the_summary_so_far_and_exits_130(tmp_path):
    """A real SIGINT to ``python -m kvpack build`` once the first pack is in the manifest."""
    import os
    import signal
    import subprocess
    import sys
    import time

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(TEXT[:200], encoding="utf-8")
    for i in range(1, 30):
        (docs / f"b{i:02d}.txt").write_text(TEXT * 8, encoding="utf-8")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(kvpack.build.__file__).parents[1]),
                                                                   os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "kvpack", "build", str(docs), "--out", str(out), "--chunk-size",
                             "256", "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and "a.kvpack" not in read_manifest(out):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "Aborted" not in stderr
    last = stdout.strip().splitlines()[-1]
    assert re.search(r"^\d+ packs? in .*: \d+ built, 0 up to date, 0 replaced; 0 failed; .*; interrupted$", last), last
    assert "a.kvpack" in read_manifest(out)


def test_tables_align_wide_characters():
    from kvpack.terminal import table

    assert table(("pack", "n"), [("文档", "1"), ("abcd", "22")], right=(1,)).splitlines() == [
        "pack   n", "文档   1", "abcd  22"]
