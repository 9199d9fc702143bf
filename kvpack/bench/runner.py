"""Run the whole benchmark: tasks x grid, speed, memory, the kvpress peer; then write the report.

``BenchConfig()`` is the default grid (sized to finish in about 20 minutes on 2 CPU cores with the embedded
reference model), ``BenchConfig.quick()`` a smoke run (about a minute). ``run_bench(config, out_dir)`` runs it and
writes ``results.json``, ``results.md`` and the PNGs into ``out_dir``; ``estimate_seconds(config)`` is the cost
model behind the ETA it prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import __version__
from .. import settings as S
from ..tasks import ANSWER_MAX_NEW_TOKENS, haystack_documents
from ..errors import InputError
from ..compress import compress
from ..model import load_model
from .continuation import continuation_docs, continuation_rows, summarize_continuation
from .grid import Variant, expand_grid
from .multiquery import multiquery_contexts, summarize_multiquery
from .needle import DEFAULT_DEPTHS, needle_contexts, summarize_needle
from .qa import answer_variants
from .report import require_matplotlib, write_report
from .speed import linear_growth, measure_memory, measure_speed

__all__ = ["TASKS", "DEFAULT_METHODS", "BenchConfig", "run_bench", "estimate_seconds"]

#: Task names, in the order they run.
TASKS = ("needle", "multiquery", "continuation", "speed", "memory")
#: Methods of the default grid: every registered method (``none`` is the ratio-1.0 row) but ``kvzip-head``, which needs
#: a head-score file (``kvpack heads``; run it as ``kvzip-head[heads=FILE]``), and ``am`` (its fit costs ~1.2x KVzip's
#: build; run it as ``am`` or ``am[values=copy]``), plus D2O's other merge modes.
DEFAULT_METHODS = ("kvzip", "d2o", "d2o[merge=values]", "d2o[merge=off]", "snapkv", "pyramidkv", "h2o",
                   "streaming", "knorm", "random")


@dataclass
class BenchConfig:
    """What to run. Lengths are in tokens (of the context, before the chat-template prefix).

    Attributes:
        methods: kvpack methods (``none`` at ratio 1.0 is always added).
        ratios: fractions kept; 1.0 is the ``none`` row.
        quants: ``none`` / ``int8`` / ``int4``, each variant stored each way.
        lengths: needle context lengths; depths: fact depths in [0, 1]; trials: contexts per (length, depth).
        mq_length, mq_facts, mq_contexts: multi-query contexts (length, facts each, how many).
        query_aware: methods also run query-aware on the multi-query task (observing the first question).
        cont_length, cont_docs, cont_target: continuation context length, passages, target tokens.
        speed_length (``None``: the longest needle length), speed_ratio, speed_repeats: the speed table.
        memory_lengths, memory_method: peak-memory builds (fresh process each).
        tasks: which of ``TASKS`` run.
        peer: ``None`` or ``"kvpress"``; peer_presses, peer_venv: its presses and virtual environment.
        model: model folder / hub id (``None``: the embedded reference model); device: ``cpu``/``cuda``/``auto``.
        haystack: a folder of ``.txt``/``.md`` documents the needle, multi-query, continuation and speed contexts
            are drawn from (``None``: the shipped CPython pages, ``kvpack.tasks.haystack_documents``; the memory
            builds always use those).
        seed: seeds every context. chunk_size, group_size, zstd_level, max_new_tokens: as ``kvpack build``/``ask``.
        threads: torch CPU threads (0: leave torch's default).
        plots: draw the PNGs (needs matplotlib).
    """

    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    ratios: list[float] = field(default_factory=lambda: [1.0, 0.5, 0.3, 0.2, 0.1])
    quants: list[str] = field(default_factory=lambda: ["none", "int4"])
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    trials: int = 1
    mq_length: int = 2048
    mq_facts: int = 8
    mq_contexts: int = 3
    query_aware: list[str] = field(default_factory=lambda: ["snapkv"])
    cont_length: int = 2048
    cont_docs: int = 3
    cont_target: int = 256
    speed_length: int | None = None
    speed_ratio: float = 0.3
    speed_repeats: int = 2
    memory_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    memory_method: str = "kvzip"
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    peer: str | None = None
    peer_presses: list[str] = field(default_factory=lambda: ["kvzip", "snapkv", "streaming"])
    peer_venv: str = ".venv-kvpress"
    model: str | None = None
    device: str = "cpu"
    seed: int = 0
    haystack: str | None = None
    chunk_size: int = 2048
    group_size: int = S.DEFAULT_GROUP_SIZE
    zstd_level: int = S.DEFAULT_ZSTD_LEVEL
    max_new_tokens: int = ANSWER_MAX_NEW_TOKENS
    threads: int = 0
    plots: bool = True

    @classmethod
    def quick(cls, **overrides) -> "BenchConfig":
        """A smoke run (about a minute on 2 cores): KVzip and StreamingLLM at ratio 0.3, 1K tokens, one context per
        depth, one multi-query context of 4 facts, one continuation passage, speed at 1K, memory at 1K/2K/4K."""
        base = dict(methods=["kvzip", "streaming"], ratios=[1.0, 0.3], quants=["none"], lengths=[1024], trials=1,
                    mq_length=1024, mq_facts=4, mq_contexts=1, cont_length=1024, cont_docs=1, speed_repeats=1,
                    memory_lengths=[1024, 2048, 4096], peer_presses=["kvzip", "streaming"])
        base.update(overrides)
        return cls(**base)

    def check(self) -> None:
        """Raise ``InputError`` for an empty or invalid setting (unknown task, method, quant, peer, bad lengths)."""
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise InputError(f"unknown task(s) {', '.join(bad)}; choose from {', '.join(TASKS)}")
        expand_grid(self.methods, self.ratios, self.quants)  # validates methods, ratios, quants
        if not self.lengths or any(l < 16 for l in self.lengths):
            raise InputError(f"lengths must be at least 16 tokens, got {self.lengths}")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise InputError(f"depths must lie in [0, 1], got {self.depths}")
        if self.trials < 1 or self.mq_contexts < 0 or self.cont_docs < 0 or self.mq_facts < 1:
            raise InputError("trials and mq_facts must be >= 1, mq_contexts and cont_docs >= 0")
        if self.peer not in (None, "kvpress"):
            raise InputError(f"unknown peer {self.peer!r}; the only peer is 'kvpress'")
        from .peer import PEER_PRESSES

        bad = [p for p in self.peer_presses if p not in PEER_PRESSES + ("knorm", "random")]
        if bad:
            raise InputError(f"unknown kvpress press(es) {', '.join(bad)}; choose from kvzip, snapkv, streaming, "
                             "knorm, random")

    def variants(self) -> list[Variant]:
        """The grid's variants (``expand_grid``)."""
        return expand_grid(self.methods, self.ratios, self.quants)

    def multiquery_variants(self) -> list[Variant]:
        """The grid's variants plus the query-aware ones (``query_aware`` methods at every ratio below 1.0)."""
        extra = [Variant(m, r, q, True) for m in self.query_aware for r in sorted(set(self.ratios), reverse=True)
                 if r < 1.0 for q in self.quants]
        return self.variants() + extra


# ---------------------------------------------------------------------------------------------------------------
# cost model (seconds on 2 shared CPU cores, one torch thread, reference model; measured on small runs)

_BUILD_1K = 0.09  # s: kvpack.compress of 1K tokens with a cheap method; grows as tokens^1.6 (attention)
_METHOD_WEIGHT = {"kvzip": 3.6, "d2o": 1.5, "h2o": 1.4}
_OPEN_S = 0.015  # s: quantize + save + load one variant
_ANSWER_1K = 0.025  # s: one greedy answer (~20 tokens) at 1K tokens; grows as tokens^0.35
_PRESS_WEIGHT = {"kvzip": 7.0}  # kvpress prefill with the press, in units of kvpack's cheap build (others: 0.7)


def _build_s(method: str, tokens: int) -> float:
    return _BUILD_1K * (tokens / 1024) ** 1.6 * _METHOD_WEIGHT.get(method.split("[", 1)[0], 1.0)  # name[options]


def _context_s(variants: list[Variant], tokens: int, questions: int) -> float:
    groups = {(v.method, v.query_aware) for v in variants}
    build = sum(_build_s(m, tokens) for m, _ in groups)
    per_answer = _ANSWER_1K * (tokens / 1024) ** 0.35
    return build + len(variants) * (_OPEN_S + questions * per_answer) + questions * 2 * per_answer


def estimate_seconds(cfg: BenchConfig, scale: float = 1.0) -> dict[str, float]:
    """Projected seconds per task for ``cfg``: a cost model fitted on the reference model (2 shared CPU cores, one
    torch thread), every term multiplied by ``scale`` (how many times slower the model at hand builds on this
    machine: ``model_scale``). Keys: the tasks, ``peer``, ``total``."""
    est = _estimate_reference_seconds(cfg)
    return {k: v * scale for k, v in est.items()}


def model_scale(model, tokenizer) -> float:
    """How many times slower than the cost model's reference (``_BUILD_1K`` seconds) a cheap build of 1,024
    tokens runs with ``model`` here: one ``kvpack.compress(..., method="streaming")`` of a 1,024-token haystack
    (about 0.1 s on the reference model, 3 s for SmolLM2-135M on 2 CPU cores), clamped to [0.05, 10,000]."""
    from .speed import needle_context_ids

    text, _ = needle_context_ids(tokenizer, 1024, model.device)
    compress(model, tokenizer, text[:400], method="streaming", ratio=0.5)  # warm-up: first calls pay one-off costs
    t0 = time.perf_counter()
    compress(model, tokenizer, text, method="streaming", ratio=0.5)
    return min(max((time.perf_counter() - t0) / _BUILD_1K, 0.05), 10_000.0)


def _estimate_reference_seconds(cfg: BenchConfig) -> dict[str, float]:
    variants = cfg.variants()
    est = {}
    if "needle" in cfg.tasks:
        est["needle"] = sum(_context_s(variants, l, 1) for l in cfg.lengths) * len(cfg.depths) * cfg.trials
    if "multiquery" in cfg.tasks:
        est["multiquery"] = _context_s(cfg.multiquery_variants(), cfg.mq_length, cfg.mq_facts) * cfg.mq_contexts
    if "continuation" in cfg.tasks:
        est["continuation"] = _context_s(variants, cfg.cont_length, 4) * cfg.cont_docs
    if "speed" in cfg.tasks:
        n = cfg.speed_length or max(cfg.lengths)
        per_round = _build_s("none", n) * 0.9 + sum(_build_s(m, n) + 2 * _OPEN_S for m in ["none", *cfg.methods])
        est["speed"] = per_round * (cfg.speed_repeats + 0.2) + 2.0
    if "memory" in cfg.tasks:
        est["memory"] = sum(5.0 + _build_s(cfg.memory_method, n) * 0.8 for n in cfg.memory_lengths)
    if cfg.peer:
        ratios = [r for r in cfg.ratios if r < 1.0]
        per = lambda l, q: (sum(_PRESS_WEIGHT.get(p, 0.7) * _build_s("none", l) + q * _ANSWER_1K  # noqa: E731
                                for p in cfg.peer_presses) * len(ratios) + 0.7 * _build_s("none", l) + q * _ANSWER_1K)
        peer = 5.0
        if "needle" in cfg.tasks:
            peer += sum(per(l, 1) for l in cfg.lengths) * len(cfg.depths) * cfg.trials
        if "multiquery" in cfg.tasks:
            peer += per(cfg.mq_length, cfg.mq_facts) * cfg.mq_contexts
        if "continuation" in cfg.tasks:  # a teacher-forced pass costs about one answer
            peer += per(cfg.cont_length, 1) * cfg.cont_docs
        est["peer"] = peer
    est["total"] = sum(est.values()) + 6.0
    return est


# ---------------------------------------------------------------------------------------------------------------


class _Progress:
    """Prints ``[task i/n] what (elapsed, ETA)``; the ETA rescales the cost model by the time actually taken."""

    def __init__(self, estimate: dict[str, float], log):
        self.estimate, self.log, self.t0 = estimate, log, time.perf_counter()
        self.done_est = 0.0

    def step(self, task: str, i: int, n: int, what: str, share: float | None = None) -> None:
        """Record item ``i`` of ``n`` of ``task`` done; ``share``: its fraction of the task's cost (default 1/n)."""
        self.done_est += self.estimate.get(task, 0.0) * (share if share is not None else 1 / max(1, n))
        elapsed = time.perf_counter() - self.t0
        scale = elapsed / max(1e-6, self.done_est)
        left = max(0.0, (self.estimate["total"] - self.done_est) * scale)
        self.log(f"[{task} {i}/{n}] {what} ({elapsed:.0f} s elapsed, ETA {left:.0f} s)")


def _environment(model, threads: int) -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": str(next(model.parameters()).device),
            "threads": threads or torch.get_num_threads(), "kvpack": __version__}


@contextlib.contextmanager
def _task(failures: dict[str, str], name: str, log: Callable[[str], None]):
    """Run one bench task: an exception is recorded in ``failures[name]`` (and logged) and the next task runs."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - one failing task must not lose the others
        failures[name] = (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0]
        log(f"  {name} FAILED: {failures[name]}")


def run_bench(cfg: BenchConfig, out_dir: str | Path = "bench-out", *, command: str = "kvpack bench",
              log=print) -> dict:
    """Run ``cfg`` and write its report into ``out_dir``; return the results dict (also ``results.json``).

    Every kvpack answer comes from a pack built from a held-out context, saved with ``kvpack.save`` and loaded with
    ``kvpack.load``; every method sees the same contexts and questions (seeded by ``cfg.seed``).

    Raises:
        InputError: an invalid config, an unreadable ``cfg.haystack`` folder (``kvpack.tasks.haystack_documents``;
        a haystack without a passage as long as a task asks fails that task, recorded under ``failures``),
        matplotlib missing while ``cfg.plots``; ``PeerError`` (an ``InputError``)
        when the kvpress environment cannot be made or its worker fails.
        ModelLoadError: the model cannot be loaded.
    """
    cfg.check()
    documents = None if cfg.haystack is None else haystack_documents(cfg.haystack)  # InputError before any work
    if cfg.plots:
        require_matplotlib()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    model, tok = load_model(cfg.model, device=cfg.device)
    scale = model_scale(model, tok)
    est = estimate_seconds(cfg, scale)
    log(f"kvpack bench: {len(cfg.variants())} variants ({', '.join(cfg.methods)} x ratios "
        f"{', '.join(f'{r:g}' for r in cfg.ratios)} x quant {', '.join(cfg.quants)}"
        + (f"; multi-query adds query-aware {', '.join(cfg.query_aware)}"
           if cfg.query_aware and "multiquery" in cfg.tasks else "")
        + f"); tasks {', '.join(cfg.tasks)}"
        + (f"; peer {cfg.peer}" if cfg.peer else "") + f"; estimated {est['total'] / 60:.1f} min "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in est.items() if k != 'total')}; cost model x{scale:.1f} "
        "for this model, from a 1K-token build timed first)")
    peer_python = None
    if cfg.peer == "kvpress":
        from .peer import ensure_kvpress_venv, model_folder

        model_folder(cfg.model)  # fail before the run if kvpress cannot load this model
        peer_python = ensure_kvpress_venv(cfg.peer_venv, log=log)
    progress = _Progress(est, log)
    results: dict = {
        "kvpack_version": __version__, "command": command, "config": dataclasses.asdict(cfg),
        "model": {"name": getattr(model, "kvpack_name", cfg.model), "parameters": sum(p.numel() for p in model.parameters()),
                  "max_position_embeddings": getattr(model.config, "max_position_embeddings", None)},
        "environment": _environment(model, cfg.threads), "variants": [v.to_dict() for v in cfg.variants()],
        "estimate_s": est,
    }
    if documents is not None:  # which text the contexts came from: enough to tell two runs' haystacks apart
        import hashlib

        joined = "\n\n".join(documents).encode("utf-8")
        results["haystack"] = {"folder": str(cfg.haystack), "documents": len(documents), "bytes": len(joined),
                               "sha256": hashlib.sha256(joined).hexdigest()}
    kw = dict(chunk_size=cfg.chunk_size, group_size=cfg.group_size, zstd_level=cfg.zstd_level)
    timings: dict[str, float] = {}
    failures: dict[str, str] = {}  # task -> why it failed; the other tasks still run
    qa_contexts, cont_docs = [], []
    with tempfile.TemporaryDirectory(prefix="kvpack-bench-") as tmp:
        if "needle" in cfg.tasks:
            with _task(failures, "needle", log):
                t0 = time.perf_counter()
                contexts = needle_contexts(tok, cfg.lengths, cfg.depths, cfg.trials, cfg.seed, documents)
                rows = []
                cost = [_context_s(cfg.variants(), ctx.length, 1) for ctx in contexts]
                for i, ctx in enumerate(contexts, 1):
                    rows += answer_variants(model, tok, ctx, cfg.variants(), tmp,
                                            max_new_tokens=cfg.max_new_tokens, **kw)
                    progress.step("needle", i, len(contexts), ctx.key, cost[i - 1] / sum(cost))
                results["needle"] = {"rows": rows}
                qa_contexts += contexts
                timings["needle"] = time.perf_counter() - t0
        if "multiquery" in cfg.tasks and cfg.mq_contexts:
            with _task(failures, "multiquery", log):
                t0 = time.perf_counter()
                contexts = multiquery_contexts(tok, cfg.mq_length, cfg.mq_facts, cfg.mq_contexts, cfg.seed,
                                               documents)
                rows = []
                for i, ctx in enumerate(contexts, 1):
                    rows += answer_variants(model, tok, ctx, cfg.multiquery_variants(), tmp,
                                            max_new_tokens=cfg.max_new_tokens, **kw)
                    progress.step("multiquery", i, len(contexts), ctx.key)
                results["multiquery"] = {"rows": rows}
                qa_contexts += contexts
                timings["multiquery"] = time.perf_counter() - t0
        if "continuation" in cfg.tasks and cfg.cont_docs:
            with _task(failures, "continuation", log):
                t0 = time.perf_counter()
                docs = cont_docs = continuation_docs(tok, cfg.cont_length, cfg.cont_docs, cfg.cont_target,
                                                     cfg.seed, documents)
                rows = []
                for i, doc in enumerate(docs, 1):
                    rows += continuation_rows(model, tok, doc, cfg.variants(), tmp, **kw)
                    progress.step("continuation", i, len(docs), doc.key)
                results["continuation"] = {"rows": rows, "summary": summarize_continuation(rows)}
                timings["continuation"] = time.perf_counter() - t0
        if "speed" in cfg.tasks:
            with _task(failures, "speed", log):
                t0 = time.perf_counter()
                n = cfg.speed_length or max(cfg.lengths)
                text = needle_contexts(tok, [n], [0.5], 1, cfg.seed, documents)[0].text
                speed_methods = ["none", *[m for m in cfg.methods if m != "none"]]
                results["speed"] = measure_speed(model, tok, text, speed_methods, cfg.speed_ratio, tmp,
                                                 repeats=cfg.speed_repeats,
                                                 chunk_size=cfg.chunk_size, zstd_level=cfg.zstd_level, log=log)
                progress.step("speed", 1, 1, f"{n} tokens")
                timings["speed"] = time.perf_counter() - t0
        if "memory" in cfg.tasks and cfg.memory_lengths:
            with _task(failures, "memory", log):
                t0 = time.perf_counter()
                mem = measure_memory(cfg.memory_lengths, cfg.memory_method, cfg.speed_ratio, model=cfg.model,
                                     chunk_size=cfg.chunk_size, threads=cfg.threads or torch.get_num_threads(),
                                     log=log)
                results["memory"] = {"method": cfg.memory_method, "ratio": cfg.speed_ratio, "rows": mem,
                                     "linear": linear_growth(mem)}
                bad = [f"{r['tokens']} tokens: {r['error']}" for r in mem if "error" in r]
                if bad:
                    failures["memory"] = "; ".join(bad)
                progress.step("memory", 1, 1, ", ".join(str(n) for n in cfg.memory_lengths))
                timings["memory"] = time.perf_counter() - t0
        if cfg.peer == "kvpress" and (qa_contexts or cont_docs):
            with _task(failures, "peer", log):
                from .peer import (baseline_agreement, continuation_baseline, export_job, model_folder,
                                   peer_continuation_rows, peer_rows, run_kvpress)

                t0 = time.perf_counter()
                job = export_job(qa_contexts, tok, model_folder(cfg.model), cfg.peer_presses, cfg.ratios,
                                 max_new_tokens=cfg.max_new_tokens, threads=cfg.threads or torch.get_num_threads(),
                                 docs=cont_docs)
                out = run_kvpress(job, peer_python, tmp, log=log)
                rows = peer_rows(out, qa_contexts)
                for task in ("needle", "multiquery"):
                    if task in results:
                        results[task]["rows"] += [r for r in rows if r["task"] == task]
                cont_rows = peer_continuation_rows(out, cont_docs)
                rows += cont_rows
                if "continuation" in results:
                    results["continuation"]["rows"] += cont_rows
                    results["continuation"]["summary"] = summarize_continuation(results["continuation"]["rows"])
                qa_rows = [r for t in ("needle", "multiquery") for r in results.get(t, {}).get("rows", [])]
                results["peer"] = {"name": "kvpress", "versions": out.get("versions", {}),
                                   "presses": cfg.peer_presses, "seconds": out.get("seconds"),
                                   "baseline_agreement": baseline_agreement(qa_rows),
                                   "continuation_baseline": continuation_baseline(
                                       results.get("continuation", {}).get("rows", [])),
                                   "errors": sorted({r["error"] for r in rows if "error" in r})}
                progress.step("peer", 1, 1, "kvpress")
                timings["peer"] = time.perf_counter() - t0
    if "needle" in results:
        results["needle"]["summary"] = summarize_needle(results["needle"]["rows"])
    if "multiquery" in results:
        results["multiquery"]["summary"] = summarize_multiquery(results["multiquery"]["rows"])
    results["task_seconds"] = timings
    results["failures"] = failures
    results["seconds"] = time.perf_counter() - t_start
    paths = write_report(results, out_dir, plots=cfg.plots)
    log(f"wrote {paths['markdown']}, {paths['json']} and {len(paths['plots'])} plot(s) in "
        f"{results['seconds']:.0f} s")
    return results
