"""Write a benchmark's results: ``results.json``, ``results.md`` (Markdown tables) and PNG plots.

Plots need matplotlib (``pip install 'kvpack[bench]'``); ``require_matplotlib`` says so before a run starts.
Accuracy is exact match in [0, 1]; ratio is the fraction of KV entries kept (kvpress's ``compression_ratio`` is
the fraction removed and has been converted); sizes are bytes of the ``.kvpack`` file per cached token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import InputError

__all__ = ["require_matplotlib", "write_report", "markdown", "plot_all", "ordered"]

INSTALL_HINT = "pip install 'kvpack[bench]'  (or: pip install matplotlib)"


def require_matplotlib() -> None:
    """Raise ``InputError`` naming the install command if matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError(f"kvpack bench draws its plots with matplotlib, which is not installed; run: {INSTALL_HINT} "
                         "(or pass --no-plots)") from None


def _method_rank(name: str, methods: list[str]) -> tuple:
    if name == "full":
        return (0, 0, "")
    if name == "none":
        return (1, 0, "")
    peer = name.startswith("kvpress:")
    base = name.split(":", 1)[1] if peer else name.removesuffix("-q")
    order = -1 if base == "none" else methods.index(base) if base in methods else len(methods)
    return (2 + int(peer), order, name)


def ordered(summary: list[dict], methods: list[str]) -> list[dict]:
    """Summary rows sorted: full cache, ``none``, kvpack methods in grid order (ratio descending, then quant),
    then the peer's rows."""
    return sorted(summary, key=lambda s: (*_method_rank(s["variant"]["name"], methods), -s["variant"]["ratio"],
                                          s["variant"]["quant"] != "none", s["variant"]["quant"]))


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _variant_cells(v: dict) -> list[str]:
    return [v["name"], "1.0 (full)" if v["name"] in ("full", "none", "kvpress:none") and v["ratio"] == 1.0 else f"{v['ratio']:g}",
            v["quant"]]


def markdown(results: dict) -> str:
    """The Markdown report: command, set-up, then one table per task and the speed/memory/size tables."""
    cfg = results["config"]
    methods = cfg["methods"]
    lines = ["# kvpack bench", "",
             f"Command: `{results.get('command', 'kvpack bench')}`", "",
             f"Model: {results['model']['name']} ({results['model'].get('parameters', '?'):,} parameters, "
             f"max positions {results['model'].get('max_position_embeddings')}); "
             f"{results['environment'].get('threads')} torch thread(s) on {results['environment'].get('device')}; "
             f"torch {results['environment'].get('torch')}, transformers {results['environment'].get('transformers')}; "
             f"seed {cfg['seed']}; took {results.get('seconds', 0):.0f} s.", "",
             "Ratio = fraction of the context's KV entries kept. Accuracy = exact match of the planted fact's code "
             "(RULER, arXiv 2404.06654). `full` = plain transformers with the ordinary full cache; `none` = the same "
             "through a kvpack file. Every kvpack answer comes from a saved and reloaded `.kvpack` file "
             f"(zstd level {cfg['zstd_level']}).", ""]
    failures = results.get("failures") or {}
    if failures:
        lines += ["## FAILED tasks", "", "These tasks failed; their tables are missing or incomplete and `kvpack bench` "
                  "exited with status 1:", ""]
        lines += [f"- **FAILED** `{task}`: {why}" for task, why in failures.items()] + [""]
    needle = results.get("needle")
    if needle and needle.get("summary"):
        lengths = [str(l) for l in cfg["lengths"]]
        lines += ["## Needle retrieval", "",
                  f"One fact per context at depths {', '.join(f'{d:g}' for d in cfg['depths'])}, "
                  f"{cfg['trials']} context(s) per depth and length.", ""]
        rows = []
        for s in ordered(needle["summary"], methods):
            rows.append(_variant_cells(s["variant"]) + [_pct(s["by_length"].get(l)) for l in lengths]
                        + [_pct(s["accuracy"]), str(s["n"]), _num(s.get("file_bytes_per_token"), "{:,.0f}"),
                           _num(s.get("build_s"), "{:.2f}")])
        lines += [_table(["method", "ratio", "quant", *[f"{l} tok" for l in lengths], "all", "n",
                          "file bytes/token", "build s"], rows), ""]
        mid = _middle_ratio(cfg["ratios"])
        if mid is not None:
            depth_keys = [f"{d:g}" for d in cfg["depths"]]
            drows = [[s["variant"]["name"]] + [_pct(s["by_depth"].get(d)) for d in depth_keys]
                     for s in ordered(needle["summary"], methods)
                     if s["variant"]["quant"] == "none" and (s["variant"]["ratio"] == mid or s["variant"]["name"] == "full")]
            lines += [f"Accuracy by depth at ratio {mid:g} (quant none; all lengths):", "",
                      _table(["method", *depth_keys], drows), ""]
    mq = results.get("multiquery")
    if mq and mq.get("summary"):
        lines += ["## Multi-query reuse", "",
                  f"{cfg['mq_contexts']} context(s) of {cfg['mq_length']} tokens with {cfg['mq_facts']} facts each; "
                  "each variant is compressed once, saved, loaded once, and asked every fact in turn from that one "
                  "cache. `-q` = query-aware (observes the first question while compressing).", ""]
        rows = [_variant_cells(s["variant"]) + [_pct(s["accuracy"]), _pct(s["first"]), _pct(s["others"]), str(s["n"])]
                for s in ordered(mq["summary"], methods)]
        lines += [_table(["method", "ratio", "quant", "all questions", "first question", "other questions",
                          "answers"], rows), ""]
    cont = results.get("continuation")
    if cont and cont.get("summary"):
        lines += ["## Continuation", "",
                  f"{cfg['cont_docs']} {'held-out' if not cfg.get('haystack') else '--haystack'} passage(s): "
                  f"context = first {cfg['cont_length']} tokens, target = "
                  f"the next {cfg['cont_target']} tokens, teacher-forced. ΔNLL = NLL(compressed) - NLL(full), "
                  "nats/token; KL = mean KL(full || compressed) of the next-token distributions, nats.", ""]
        rows = [_variant_cells(s["variant"]) + [_num(s["nll"], "{:.3f}"), _num(s["delta_nll"], "{:+.3f}"),
                                                 _num(s["kl"], "{:.3f}"), _pct(s["top1_agreement"])]
                for s in ordered(cont["summary"], methods)]
        lines += [_table(["method", "ratio", "quant", "NLL", "ΔNLL/token", "KL", "top-1 agreement"], rows), ""]
    sp = results.get("speed")
    if sp:
        lines += ["## Speed and size", "",
                  f"One context of {sp['tokens']} tokens, methods at ratio {sp['ratio']:g} (`none` at 1.0), medians of "
                  f"{sp['repeats']} interleaved round(s). Plain prefill (transformers, `DynamicCache`): "
                  f"{sp['prefill_s']:.3f} s; one decode step over the full cache: {1000 * sp['decode_full_s']:.2f} ms.",
                  ""]
        rows = []
        for m in sp["build_s"]:
            rows.append([m, f"{sp['build_s'][m]:.3f}", f"{sp['build_vs_prefill'][m]:.2f}x", f"{sp['load_s'][m]:.4f}",
                         f"{sp['load_speedup_vs_prefill'][m]:.0f}x", f"{1000 * sp['decode_loaded_s'][m]:.2f}",
                         f"{sp['decode_vs_full'][m]:.2f}x", f"{sp['bytes_per_token'][m]:,.0f}"])
        lines += [_table(["method", "build s", "build / prefill", "load s", "re-prefill / load", "decode step ms",
                          "decode / full", "file bytes/token"], rows), ""]
    mem = results.get("memory")
    if mem and mem.get("rows"):
        rows = []
        for r in mem["rows"]:
            if "error" in r:
                rows.append([str(r["tokens"]), "error: " + r["error"], "-", "-", "-"])
            else:
                rows.append([f"{r['tokens']:,}", f"{r['growth_bytes'] / 2**20:.1f}",
                             f"{r['growth_bytes'] / 2**10 / r['tokens']:.1f}", f"{r['build_s']:.2f}",
                             "yes (for this measurement only)" if r.get("extended_positions") else "no"])
        lines += [f"Peak memory of a `{mem['method']}` build (ratio {mem['ratio']:g}), each length in a fresh process "
                  "(peak RSS growth over the resident size before the build). Up to one prefill chunk "
                  f"({cfg['chunk_size']} tokens) the chunk's attention grows quadratically; beyond it the growth "
                  "should be linear, so the check compares the two longest lengths:", "",
                  _table(["tokens", "peak growth MiB", "KiB per token", "build s", "beyond max positions"], rows), ""]
        lin = mem.get("linear")
        if lin:
            lines += [f"{lin['from_tokens']:,} -> {lin['to_tokens']:,} tokens ({lin['token_ratio']:.1f}x): peak growth "
                      f"x{lin['growth_ratio']:.2f}, " + ("at most linear." if lin["linear"] else "MORE THAN LINEAR."),
                      ""]
    peer = results.get("peer")
    if peer:
        lines += ["## Peer: NVIDIA kvpress", ""]
        if peer.get("error"):
            lines += [f"kvpress did not run: {peer['error']}", ""]
        else:
            v = peer.get("versions", {})
            lines += [f"kvpress {v.get('kvpress')} (transformers {v.get('transformers')}, torch {v.get('torch')}) in "
                      f"its own virtual environment; presses {', '.join(peer['presses'])} with default parameters at "
                      f"the same ratios on the same token ids (kvpack's chat layout) and questions; "
                      f"{peer.get('seconds', 0):.0f} s. Its rows are `kvpress:<press>` above. kvpress masks evicted "
                      "entries of its KVzip press during decoding instead of removing them (no memory is saved) and "
                      "keeps no file; its `build s` is its prefill with the press. `kvpress:none` is kvpress's path "
                      "without a press (a set-up check)."]
            agree = peer.get("baseline_agreement") or {}
            if agree.get("total"):
                lines += ["", f"Set-up check: `kvpress:none` answered exactly as kvpack's `full` on "
                              f"{agree['identical']} of {agree['total']} questions."]
            checks = [c for c in peer.get("continuation_baseline") or [] if c.get("kvpack") is not None]
            if checks:
                lines += ["", "Continuation: kvpress's rows are measured against kvpress's own run without a press "
                              "(`kvpress:none`); set-up check, NLL of kvpack's `full` / `kvpress:none`: "
                              + "; ".join(f"{c['key']} {c['kvpack']:.4f} / {c['kvpress']:.4f}" for c in checks) + "."]
            if peer.get("errors"):
                lines += ["", "kvpress errors: " + "; ".join(peer["errors"])]
            lines += [""]
    plots = results.get("plots") or []
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def _middle_ratio(ratios: list[float]) -> float | None:
    below = sorted(r for r in ratios if r < 1.0)
    if not below:
        return None
    return 0.3 if 0.3 in below else below[len(below) // 2]


def _base(name: str) -> str:
    """The kvpack method a row belongs to: ``kvpress:kvzip`` -> ``kvzip``, ``snapkv-q`` -> ``snapkv``."""
    return name.split(":", 1)[-1].removesuffix("-q")


def _curves(summary: list[dict], metric: str, quant: str) -> dict[str, list[tuple[float, float]]]:
    """``{method name: [(ratio, value)]}`` for one quant, each kvpack curve starting at ``none``'s ratio-1.0 point."""
    none = next((s for s in summary if s["variant"]["name"] == "none" and s["variant"]["quant"] == quant), None)
    curves: dict[str, list[tuple[float, float]]] = {}
    for s in summary:
        v = s["variant"]
        if v["name"] in ("full", "none", "kvpress:none") or s.get(metric) is None:
            continue
        if v["quant"] != quant and not v["name"].startswith("kvpress:"):
            continue
        if v["name"].startswith("kvpress:") and quant != "none":
            continue
        curves.setdefault(v["name"], []).append((v["ratio"], s[metric]))
    for name, pts in curves.items():
        if none is not None and none.get(metric) is not None and not any(r == 1.0 for r, _ in pts):
            pts.append((1.0, none[metric]))
        pts.sort()
    return curves


def _plot_metric(plt, summary: list[dict], metric: str, quants: list[str], title: str, ylabel: str, path: Path,
                 full_value: float | None = None, ylim=None) -> Path:
    fig, axes = plt.subplots(1, len(quants), figsize=(5.2 * len(quants), 4), squeeze=False, sharey=True)
    ticks = sorted({s["variant"]["ratio"] for s in summary} | {1.0})
    cmap = plt.get_cmap("tab10")
    bases = sorted({_base(s["variant"]["name"]) for s in summary})
    for ax, q in zip(axes[0], quants):
        for name, pts in sorted(_curves(summary, metric, q).items()):
            style = "--" if name.startswith("kvpress:") else ":" if name.endswith("-q") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", markersize=3, label=name,
                    color=cmap(bases.index(_base(name)) % 10))
        if full_value is not None:
            ax.axhline(full_value, color="grey", linewidth=0.8, linestyle=":", label="full cache")
        ax.set_title(f"{title} (quant {q})", fontsize=10)
        ax.set_xlabel("ratio kept")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks])
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles.keys()), fontsize=7, loc="center left",
               bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_all(results: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Draw the PNGs into ``out_dir``: accuracy vs ratio per method for the needle and multi-query tasks (one panel
    per quantization; kvpress dashed), ΔNLL and KL vs ratio for the continuation, and file bytes per token vs
    needle accuracy. Returns the paths written. Raises ``InputError`` if matplotlib is missing."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    quants = results["config"]["quants"]
    paths = []

    def full_of(summary, metric):
        return next((s[metric] for s in summary if s["variant"]["name"] == "full"), None)

    needle = (results.get("needle") or {}).get("summary")
    if needle:
        paths.append(_plot_metric(plt, needle, "accuracy", quants, "Needle retrieval", "accuracy (exact match)",
                                  out / "needle_accuracy.png", full_of(needle, "accuracy"), (-0.03, 1.03)))
    mq = (results.get("multiquery") or {}).get("summary")
    if mq:
        paths.append(_plot_metric(plt, mq, "accuracy", quants, "Multi-query reuse", "accuracy, all questions",
                                  out / "multiquery_accuracy.png", full_of(mq, "accuracy"), (-0.03, 1.03)))
    cont = (results.get("continuation") or {}).get("summary")
    if cont:
        paths.append(_plot_metric(plt, cont, "delta_nll", quants, "Continuation", "ΔNLL (nats/token) vs full cache",
                                  out / "continuation_delta_nll.png", 0.0))
        paths.append(_plot_metric(plt, cont, "kl", quants, "Continuation", "KL(full || compressed), nats",
                                  out / "continuation_kl.png", 0.0))
    if needle:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        names = sorted({s["variant"]["name"] for s in needle if s.get("file_bytes_per_token")})
        cmap = plt.get_cmap("tab10")
        for i, name in enumerate(names):
            for q, marker in (("none", "o"), ("int8", "s"), ("int4", "^")):
                pts = [(s["file_bytes_per_token"], s["accuracy"]) for s in needle
                       if s["variant"]["name"] == name and s["variant"]["quant"] == q and s.get("file_bytes_per_token")]
                if pts:
                    ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=cmap(i % 10),
                               label=f"{name} ({q})", s=22)
        ax.set_xscale("log")
        ax.set_xlabel("file bytes per context token (log)")
        ax.set_ylabel("needle accuracy")
        ax.set_ylim(-0.03, 1.03)
        ax.set_title("File size vs needle accuracy", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2, loc="best")
        fig.tight_layout()
        path = out / "size_vs_accuracy.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(results: dict, out_dir: str | os.PathLike, *, plots: bool = True) -> dict[str, Path]:
    """Write ``results.json``, the PNGs (when ``plots``) and ``results.md`` into ``out_dir`` (created).

    Returns ``{"json": path, "markdown": path, "plots": [paths]}``. Raises ``InputError`` if ``plots`` and
    matplotlib is missing; ``OSError`` if the folder cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot_all(results, out) if plots else []
    results["plots"] = [p.name for p in pngs]
    json_path = out / "results.json"
    json_path.write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    md_path = out / "results.md"
    md_path.write_text(markdown(results), encoding="utf-8")
    return {"json": json_path, "markdown": md_path, "plots": pngs}
