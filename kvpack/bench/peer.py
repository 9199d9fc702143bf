"""The peer: NVIDIA kvpress (PyPI ``kvpress``) run on the same model, contexts, questions and ratios.

kvpress pins an older transformers (``kvpress`` 0.5.5: ``transformers>=4.56,<5.3``) than kvpack, so it runs in its
own virtual environment (default ``.venv-kvpress/``, git-ignored) made with ``python -m venv``: ``torch`` first, at
the version this environment runs (a CPU build where one lies on the machine; a bare ``pip install torch`` could
pull a multi-GB CUDA build), then ``kvpress`` (which brings its own transformers). kvpack exports a JSON job with
the exact token ids it uses (``export_job``); ``kvpress_worker.py`` runs kvpress's presses on them inside that
environment; ``peer_rows`` turns its answers into rows scored exactly like kvpack's (``kvpack.tasks.answer_matches``).

Presses: ``kvzip`` (KVzipPress, arXiv 2505.23416), ``snapkv`` (SnapKVPress, arXiv 2404.14469), ``streaming``
(StreamingLLMPress, arXiv 2309.17453), each with kvpress's default parameters. kvpress's ``compression_ratio`` is
the fraction REMOVED; the worker passes ``1 - ratio``. kvpress keeps no file and its KVzip press masks evicted keys
instead of removing them (no memory is saved), so kvpress rows have no file size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..errors import InputError
from ..layout import chat_layout
from .. import tasks
from .qa import QAContext

__all__ = ["PEER_PRESSES", "KVPRESS_REQUIREMENT", "DEFAULT_VENV", "PeerError", "ensure_kvpress_venv", "export_job",
           "run_kvpress", "peer_rows", "peer_continuation_rows", "continuation_baseline", "baseline_agreement",
           "model_folder"]

#: kvpress presses the benchmark runs by default.
PEER_PRESSES = ("kvzip", "snapkv", "streaming")
#: The kvpress release the peer environment installs (its worker relies on this release's pipeline methods).
KVPRESS_REQUIREMENT = "kvpress==0.5.5"
#: Where the peer's virtual environment goes by default (relative to the current folder).
DEFAULT_VENV = ".venv-kvpress"
WORKER = Path(__file__).with_name("kvpress_worker.py")


class PeerError(InputError):
    """The kvpress environment could not be made or the worker failed; the message says what and how to fix."""


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _torch_requirement() -> str:
    """``torch==X.Y.Z`` for the torch this process runs (local build tags such as ``+cpu`` dropped)."""
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def ensure_kvpress_venv(venv: str | os.PathLike = DEFAULT_VENV, *, log=print, timeout_s: float = 1800.0) -> Path:
    """Make (or reuse) the kvpress virtual environment; return its Python interpreter.

    Reused as is when its Python imports ``kvpress``. Otherwise: ``python -m venv VENV``, then
    ``pip install torch==<this torch>``, then ``pip install kvpress==0.5.5`` (with its dependencies, from the
    package index pip is configured with).

    Raises:
        PeerError: venv creation or an install failed (the message quotes pip's last lines; typical causes: no
            access to the package index, or no torch build for this platform).
    """
    venv = Path(venv).absolute()
    python = _venv_python(venv)
    if python.exists() and subprocess.run([str(python), "-c", "import kvpress"], capture_output=True).returncode == 0:
        return python
    steps = []
    if not python.exists():
        steps.append([sys.executable, "-m", "venv", str(venv)])
    steps += [[str(python), "-m", "pip", "install", "-q", _torch_requirement()],
              [str(python), "-m", "pip", "install", "-q", KVPRESS_REQUIREMENT]]
    for cmd in steps:
        log(f"peer: {' '.join(cmd[-3:] if 'pip' in cmd else cmd)} ...")
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise PeerError(f"making the kvpress environment timed out: {' '.join(cmd)}") from None
        if res.returncode != 0:
            tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
            raise PeerError(f"could not make the kvpress environment in {venv} ({' '.join(cmd[-2:])}): {tail}. "
                            f"Fix the cause, or remove {venv} and retry")
    if subprocess.run([str(python), "-c", "import kvpress"], capture_output=True).returncode != 0:
        raise PeerError(f"kvpress was installed in {venv} but does not import; remove {venv} and retry")
    return python


def model_folder(model: str | None) -> Path:
    """The local Hugging Face model folder kvpress should load: the embedded reference model for ``None``; for a
    GGUF file, a folder holding one, or a short name (``smollm2-135m``), the folder kvpack converted it into
    (``kvpack.gguf.converted_folder``: the same float32 weights kvpack's own rows run on).

    Raises ``PeerError`` for a hub id (the peer needs the same weights on disk); ``ModelLoadError`` when the model
    cannot be found or converted (as ``kvpack.load_model`` would).
    """
    from .. import gguf
    from ..model import model_path

    path, is_local = model_path(model)
    if not is_local:
        raise PeerError(f"--peer kvpress needs --model to be a local model folder or GGUF file, got {model!r}")
    path = Path(path)
    if gguf.is_gguf(path):
        path = gguf.converted_folder(path)
    return path.absolute()


def export_job(contexts: list[QAContext], tokenizer, model_dir: str | os.PathLike, presses: list[str],
               ratios: list[float], *, max_new_tokens: int = tasks.ANSWER_MAX_NEW_TOKENS, threads: int = 1,
               docs: list | tuple = ()) -> dict:
    """The worker's job: kvpack's exact token ids for every context (prefix + context) and question, and for every
    continuation passage (``docs``: ``kvpack.bench.continuation.ContinuationDoc``) its context and target ids.

    Ratios of 1.0 are dropped (kvpress would compress nothing); instead every context is also run once through
    kvpress's path without a press (``baseline``: the ``kvpress:none`` rows), whose answers must equal kvpack's
    full-cache reference (``baseline_agreement``) and whose continuation log-probabilities are the reference of
    kvpress's own ΔNLL, KL and top-1 agreement (``peer_continuation_rows``).
    """
    layout = chat_layout(tokenizer)
    items = []
    for ctx in contexts:
        items.append({"task": ctx.task, "key": ctx.key,
                      "context_ids": layout.prefix_ids(tokenizer) + layout.encode_text(tokenizer, ctx.text),
                      "questions_ids": [layout.question_ids(tokenizer, q) for q in ctx.questions]})
    for doc in docs:  # the same ids as kvpack.bench.continuation.fullcache_logprobs feeds
        items.append({"task": "continuation", "key": doc.key,
                      "context_ids": layout.prefix_ids(tokenizer) + layout.encode_text(tokenizer, doc.text),
                      "target_ids": list(doc.target_ids)})
    return {"model": str(model_dir), "max_new_tokens": int(max_new_tokens), "threads": int(threads), "baseline": True,
            "presses": list(presses), "ratios": [float(r) for r in ratios if r < 1.0], "items": items}


def run_kvpress(job: dict, python: str | os.PathLike, folder: str | os.PathLike, *, log=print,
                timeout_s: float = 3600.0) -> dict:
    """Run ``kvpress_worker.py`` on ``job`` with the kvpress environment's ``python``; return its results dict.

    The job and results are JSON files in ``folder``; the worker's progress lines go to ``log``.

    Raises:
        PeerError: the worker exited non-zero (its last stderr lines are quoted) or timed out.
    """
    folder = Path(folder)
    job_path, res_path = folder / "kvpress_job.json", folder / "kvpress_results.json"
    job_path.write_text(json.dumps(job), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS=str(job.get("threads", 1)), PYTHONNOUSERSITE="1")
    env.pop("PYTHONPATH", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(python), str(WORKER), str(job_path), str(res_path)], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=env)
    tail: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        line = line.rstrip()
        tail = (tail + [line])[-5:]
        if line.startswith("kvpress "):
            log("  peer " + line)
        if time.perf_counter() - t0 > timeout_s:
            proc.kill()
            raise PeerError(f"the kvpress worker ran past {timeout_s:.0f} s and was stopped")
    if proc.wait() != 0 or not res_path.exists():
        raise PeerError(f"the kvpress worker failed (exit {proc.returncode}): {' | '.join(tail)}")
    out = json.loads(res_path.read_text(encoding="utf-8"))
    out["seconds"] = time.perf_counter() - t0
    return out


def peer_rows(results: dict, contexts: list[QAContext]) -> list[dict]:
    """Rows like ``kvpack.bench.qa.answer_variants``'s for kvpress's answers (one per question), scored by
    ``kvpack.tasks.answer_matches``; the variant is ``kvpress:<press>`` at the kept ratio, quant ``none``.
    Rows whose press failed carry ``error`` and are not scored."""
    by_key = {c.key: c for c in contexts}
    rows = []
    for r in results.get("rows", []):
        ctx = by_key.get(r["key"])
        if ctx is None:
            continue
        name = f"kvpress:{r['press']}"
        variant = {"method": name, "name": name, "ratio": r["ratio"], "quant": "none", "query_aware": False,
                   "label": f"{name}@{r['ratio']:g}"}
        if "error" in r:
            rows.append({"task": ctx.task, "key": ctx.key, "length": ctx.length, "variant": variant,
                         "error": r["error"]})
            continue
        kept = r["kv_entries"] / max(1, r["kv_entries_full"])
        for i, (answer, fact) in enumerate(zip(r["answers"], ctx.facts)):
            rows.append({"task": ctx.task, "key": ctx.key, "length": ctx.length, "depth": ctx.depths[i],
                         "question_index": i, "variant": variant, "answer": answer.strip(),
                         "correct": tasks.answer_matches(answer, fact), "answer_s": r["answer_s"][i],
                         "build_s": r["compress_s"], "kept_fraction": kept, "file_bytes": None,
                         "bytes_per_token": None})
    return rows


def peer_continuation_rows(results: dict, docs: list) -> list[dict]:
    """Continuation rows like ``kvpack.bench.continuation.continuation_rows``'s for kvpress's presses on ``docs``:
    ``nll`` (nats/token), ``delta_nll`` against kvpress's own run without a press on the same passage (``nll`` minus
    that run's), ``kl`` and ``top1_agreement`` against that run, ``build_s`` (kvpress's prefill with the press) and
    ``kept_fraction``; the variant is ``kvpress:<press>`` at the kept ratio. The run without a press is the row
    ``kvpress:none`` (ratio 1, ΔNLL 0). Rows whose press failed carry ``error``."""
    by_key = {d.key: d for d in docs}
    got = [r for r in results.get("rows", []) if r.get("task") == "continuation" and r.get("key") in by_key]
    base = {r["key"]: r["nll"] for r in got if r["press"] == "none" and "nll" in r}
    rows = []
    for r in got:
        doc = by_key[r["key"]]
        name = f"kvpress:{r['press']}"
        variant = {"method": name, "name": name, "ratio": r["ratio"], "quant": "none", "query_aware": False,
                   "label": f"{name}@{r['ratio']:g}"}
        row = {"task": "continuation", "key": doc.key, "length": doc.length, "target_tokens": len(doc.target_ids) - 1,
               "variant": variant}
        if "error" in r or "nll" not in r or r["key"] not in base:
            rows.append({**row, "error": r.get("error", "no run without a press to compare with")})
            continue
        rows.append({**row, "nll": r["nll"], "delta_nll": r["nll"] - base[r["key"]], "kl": r["kl"],
                     "top1_agreement": r["top1_agreement"], "build_s": r["compress_s"],
                     "kept_fraction": r["kv_entries"] / max(1, r["kv_entries_full"]), "file_bytes": None,
                     "bytes_per_token": None})
    return rows


def continuation_baseline(rows: list[dict]) -> list[dict]:
    """The continuation set-up check: per passage, kvpack's full-cache NLL (row ``full``) beside kvpress's without a
    press (``kvpress:none``): ``[{"key", "kvpack", "kvpress"}]`` (nats/token). Both run the same model on the same
    token ids in different transformers releases, so they should agree to float32 rounding."""
    full = {r["key"]: r["nll"] for r in rows if r.get("variant", {}).get("name") == "full" and "nll" in r}
    return [{"key": r["key"], "kvpack": full.get(r["key"]), "kvpress": r["nll"]} for r in rows
            if r.get("variant", {}).get("name") == "kvpress:none" and "nll" in r]


def baseline_agreement(rows: list[dict]) -> dict:
    """How often kvpress without a press (``kvpress:none``) answers exactly as kvpack's full-cache reference
    (``full``) on the same context and question: ``{"identical", "total"}``. Both run the same model on the same
    token ids (in different transformers releases), so anything below ``total`` points at a set-up difference."""
    full = {(r["key"], r["question_index"]): r["answer"] for r in rows
            if r.get("variant", {}).get("name") == "full" and "answer" in r}
    base = [(r["key"], r["question_index"], r["answer"]) for r in rows
            if r.get("variant", {}).get("name") == "kvpress:none" and "answer" in r]
    same = sum(1 for k, i, a in base if full.get((k, i)) == a)
    return {"identical": same, "total": len(base)}
