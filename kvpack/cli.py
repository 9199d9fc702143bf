"""The ``kvpack`` command line: parses arguments, calls the library, formats the results.

    kvpack build docs/ --ratio 0.3          # one .kvpack per document, in ../packs beside docs/
    kvpack info packs/notes.kvpack
    kvpack verify packs/notes.kvpack --model PATH
    kvpack ask packs/notes.kvpack "What is the secret code?"

Every ``KvpackError`` is printed as ``error: <message>`` on stderr, without a traceback, and the exit status is 1;
usage errors (bad options) keep click's status 2.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from . import __version__
from . import constants as C
from .build import build as build_packs
from .build import check_compatible, check_pack, default_out_dir, discover_contexts
from .compress import DEFAULT_CHUNK_SIZE, DEFAULT_RATIO
from .errors import InputError, KvpackError
from .fileformat import load_pack, read_header
from .generation import generate
from .loading import cache_from_pack
from .methods import METHODS
from .methods.base import SCOPES
from .methods.d2o import MERGE_MODES
from .methods.kvzip_plus import SCORINGS
from .model import load_model

__all__ = ["cli", "main"]

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_MODEL_HELP = "Hugging Face model folder or hub id [default: the embedded reference model]."


class _Group(click.Group):
    """A group that turns every ``KvpackError`` into ``error: <message>`` on stderr and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KvpackError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)


def _model_options(f):
    f = click.option("--dtype", type=click.Choice(_DTYPES), default="auto", show_default=True,
                     help="Model dtype (auto: bfloat16 on CUDA, float32 on CPU).")(f)
    f = click.option("--device", type=click.Choice(_DEVICES), default="auto", show_default=True,
                     help="Where to run the model (auto: CUDA when available).")(f)
    return f


def _load(model: str | None, device: str, dtype: str):
    click.echo(f"loading model {model or '(embedded reference model)'} ...", err=True)
    return load_model(model, device=device, dtype=dtype)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvpack")
def cli():
    """Compress an LLM's KV cache of a document once into a .kvpack file, then ask it questions."""


# ---------------------------------------------------------------------------------------------------------------
# build

#: CLI option -> method parameter; each method takes the parameters its class declares (``kvpack.methods``).
_METHOD_FLAGS = {"sink": "--sink", "recent_ratio": "--recent-ratio", "merge": "--merge",
                 "beta": "--beta", "budget": "--budget", "window": "--window", "question": "--question",
                 "seed": "--seed", "heads": "--heads", "scoring": "--score"}


def _method_options(f):
    opts = [
        click.option("--seed", type=int, default=None, help="random: seed [default: 0]."),
        click.option("--question", default=None, metavar="TEXT",
                     help="snapkv, pyramidkv: observe this question instead of the context's tail (query-aware)."),
        click.option("--window", type=click.IntRange(min=0), default=None,
                     help="snapkv, pyramidkv: observation window in tokens [default: 64]; kvzip-head: recent "
                          "context tokens also kept in dropped heads [default: 0]."),
        click.option("--heads", default=None, metavar="FILE",
                     help="kvzip-head: the model's head scores (made once by `kvpack heads`)."),
        click.option("--score", "scoring", type=click.Choice(SCORINGS), default=None,
                     help="kvzip: attention (the paper's) or plus (KVzip+: weighted by each entry's output norm "
                          "relative to the query's hidden state, as kvpress's KVzipPress) [default: attention]."),
        click.option("--budget", type=click.Choice(SCOPES), default=None,
                     help="h2o, snapkv, knorm, random (any), pyramidkv (layer or head): scope of the top-k; "
                          "global gives heads non-uniform budgets [default: head]."),
        click.option("--beta", type=float, default=None,
                     help="d2o: EMA weight of the merge threshold [default: 0.7]; pyramidkv: pyramid steepness "
                          "[default: 20]."),
        click.option("--merge", type=click.Choice(MERGE_MODES), default=None,
                     help="d2o: what merging evicted entries into their nearest kept one changes: keys+values (the "
                          "paper's), values only (kept keys stay as prefilled), or off (eviction alone) "
                          "[default: keys+values]."),
        click.option("--recent-ratio", type=float, default=None,
                     help="d2o: recent window's share of a head's non-sink budget, M/(N+M) [default: 0.25, N:M=3:1]."),
        click.option("--sink", type=click.IntRange(min=0), default=None,
                     help="d2o, streaming: attention-sink tokens kept at the start of the context [default: 4]."),
    ]
    for opt in opts:
        f = opt(f)
    return f


def _method_params(method: str, given: dict) -> dict:
    """The method options given on the command line; ``InputError`` for one the method does not take."""
    given = {k: v for k, v in given.items() if v is not None}
    takes = METHODS[method].parameter_names()
    wrong = [_METHOD_FLAGS[k] for k in given if k not in takes]
    if wrong:
        own = [_METHOD_FLAGS[k] for k in takes if k in _METHOD_FLAGS]
        raise InputError(f"--method {method} does not take {', '.join(wrong)} "
                         f"({'its options: ' + ', '.join(own) if own else 'it has no method options'})")
    return given


@cli.command()
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH", help=_MODEL_HELP)
@click.option("--method", type=click.Choice(sorted(METHODS)), default="kvzip", show_default=True,
              help="Compression method (scores the KV entries).")
@click.option("--ratio", type=click.FloatRange(0.0, 1.0, min_open=True), default=DEFAULT_RATIO, show_default=True,
              help="Fraction of the context's KV entries kept (kvzip-head: of the (layer, KV head) pairs kept whole).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Output folder [default: packs/ beside the first input: docs/ -> docs/../packs, "
                   "docs/a.txt -> docs/packs].")
@_model_options
@click.option("--chunk-size", type=click.IntRange(min=1), default=DEFAULT_CHUNK_SIZE, show_default=True,
              help="Tokens per prefill and scoring chunk (bounds memory).")
@click.option("--quant", type=click.Choice(C.QUANT_CHOICES), default=C.QUANT_NONE, show_default=True,
              help="Quantize the kept KV: keys per channel, values per token (KIVI grouping); the attention sink "
                   "stays in full precision. With --checksum xxh3 the compact layout (format v5: key code widths "
                   "per channel chosen from the context's queries, 8-bit group parameters); with sha256 the "
                   "KIVI layout of format v2.")
@click.option("--group-size", type=click.Choice([str(g) for g in C.GROUP_SIZES]), default=str(C.DEFAULT_GROUP_SIZE),
              show_default=True, help="Quantization group: tokens per key scale, channels per value scale (at most head_dim).")
@click.option("--zstd-level", type=click.IntRange(0, C.ZSTD_MAX_LEVEL), default=C.DEFAULT_ZSTD_LEVEL,
              show_default=True, help="zstd-compress each tensor at this level (0: off).")
@click.option("--checksum", type=click.Choice(C.CHECKSUMS), default=C.DEFAULT_CHECKSUM, show_default=True,
              help="Tensor checksum: xxh3 (XXH3-128, fast to verify; detects damage, not tampering) or sha256 "
                   "(cryptographic; files readable by kvpack 0.1: v1 with --quant none --zstd-level 0, else v2).")
@click.option("--overwrite", is_flag=True, help="Rebuild packs that are already up to date (a pack built with other "
                                                "settings is always rebuilt and replaced).")
@_method_options
def build(inputs, model_name, method, ratio, out_dir, device, dtype, chunk_size, quant, group_size, zstd_level,
          checksum, overwrite, **method_options):
    """Compress each document in INPUT... into <name>.kvpack.

    INPUT is .txt/.md files (one document each, named after the file), .jsonl files (one document per line:
    {"id": ..., "text": ...}, named <file>-<id> or <file>-<line>) or folders of them, walked recursively.
    Packs that are already up to date (same text, method, parameters, ratio, quantization, zstd level, checksum and
    model) are skipped.
    The method options below apply to the methods named in their help; giving one to another method is an error.
    """
    from tqdm import tqdm

    options = _method_params(method, method_options)
    contexts = discover_contexts(inputs)
    out = Path(out_dir) if out_dir is not None else default_out_dir(inputs)
    model, tokenizer = _load(model_name, device, dtype)
    bar = functools.partial(tqdm, unit="tok", unit_scale=True, desc="compressing",
                            file=sys.stderr, dynamic_ncols=True)
    results = build_packs(contexts, model, tokenizer, out_dir=out, method=method, ratio=ratio,
                          chunk_size=chunk_size, overwrite=overwrite, progress_factory=bar, quant=quant,
                          group_size=int(group_size), zstd_level=zstd_level, checksum=checksum, **options)
    rows = [(r.name, f"{r.tokens:,}", f"{r.entries_kept:,}", f"{r.bytes_written:,}", f"{r.seconds:.2f}",
             "skipped (up to date)" if r.skipped else "built") for r in results]
    click.echo(_table(("context", "tokens", "entries kept", "bytes", "seconds", "status"), rows,
                      right=(1, 2, 3, 4)))
    built = [r for r in results if not r.skipped]
    click.echo(f"{len(results)} packs in {out}: {len(built)} built, {len(results) - len(built)} skipped; "
               f"{sum(r.bytes_written for r in built):,} bytes written in {sum(r.seconds for r in results):.1f} s")


# ---------------------------------------------------------------------------------------------------------------
# heads


@cli.command()
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH", help=_MODEL_HELP)
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False), metavar="FILE",
              help="The head-score file to write (safetensors), e.g. heads.safetensors.")
@click.option("--score", "scoring", type=click.Choice(SCORINGS), default="attention", show_default=True,
              help="KVzip's entry scores (attention) or KVzip+'s (plus).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=DEFAULT_CHUNK_SIZE, show_default=True,
              help="Tokens per prefill and repeat-pass chunk.")
@_model_options
def heads(inputs, model_name, out_file, scoring, chunk_size, device, dtype):
    """Score the model's KV heads once for `kvpack build --method kvzip-head` (KVzip's context-independent mode).

    Each context in INPUT... (as for build) is prefilled and scored by KVzip's repeat pass; a (layer, KV head)
    pair scores the max of its entries' scores, maximised over the contexts. A few contexts of a few thousand
    tokens, of the kind of text to be compressed, are enough (arXiv 2505.23416, section 3.3).
    """
    from .heads import head_scores, save_head_scores

    contexts = discover_contexts(inputs)
    model, tokenizer = _load(model_name, device, dtype)
    done = lambda i, n: click.echo(f"scored {i}/{n} contexts", err=True)  # noqa: E731
    scores = head_scores(model, tokenizer, [c.text for c in contexts], names=[c.name for c in contexts],
                         scoring=scoring, chunk_size=chunk_size, progress=done)
    written = save_head_scores(scores, out_file)
    rows = [(str(l), *(f"{float(v):.4f}" for v in row)) for l, row in zip(scores.compressed_layers, scores.scores)]
    click.echo(_table(("layer", *(f"head {h}" for h in range(scores.scores.shape[1]))), rows,
                      right=tuple(range(scores.scores.shape[1] + 1))))
    click.echo(f"{out_file}: head scores of {len(rows)} layers x {scores.scores.shape[1]} KV heads from "
               f"{len(contexts)} contexts ({sum(c['tokens'] for c in scores.contexts):,} tokens), {written:,} bytes")


# ---------------------------------------------------------------------------------------------------------------
# info


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
def info(file):
    """Describe a .kvpack file: model, method, sizes, entries kept per layer."""
    pack = load_pack(file)  # validates the whole file
    header = read_header(file)
    meta = header.metadata
    fp = meta.get("fingerprint") or {}
    stats = meta.get("stats") or {}
    source = meta.get("source") or {}
    params = meta.get("method_params") or {}
    rope = fp.get("rope") or {}
    sliding = fp.get("sliding_layers") or []
    rows = [
        ("file", str(file)),
        ("format", f"kvpack v{header.format_version}, {header.file_bytes:,} bytes, tensor checksums "
                   f"{C.CHECKSUM_NAMES[header.checksum]}"),
        ("kvpack version", str(meta.get("kvpack_version", "?"))),
        ("model", str(fp.get("name") or "?")),
        ("  architecture", f"{fp.get('architecture', '?')} ({fp.get('model_type', '?')})"),
        ("  layers", str(fp.get("num_layers", "?"))),
        ("  heads", f"{fp.get('num_heads', '?')} query, {fp.get('num_kv_heads', '?')} KV"),
        ("  head dim", str(fp.get("head_dim", "?"))),
        ("  RoPE", ", ".join(f"{k}={v}" for k, v in sorted(rope.items())) or "-"),
        ("  sliding layers", (f"{', '.join(map(str, sliding))} (window {fp.get('sliding_window')}, kept intact)"
                              if sliding else "none")),
        ("  KV dtype", str(fp.get("dtype", "?"))),
        ("  tokenizer", f"sha256 {_short(fp.get('tokenizer_sha256'))}"),
        ("  weights", f"sha256 {_short(fp.get('weights_sha256'))}"),
        ("method", f"{meta.get('method', '?')}"
                   + (f" ({', '.join(f'{k}={v}' for k, v in sorted(params.items()))})" if params else "")),
        ("ratio", str(meta.get("ratio", "?"))),
        ("quantization", _quantization(header, pack)),
        ("zstd", (f"level {header.zstd_level}: {header.file_bytes:,} bytes on disk, "
                  f"{header.header_bytes + header.raw_bytes:,} decoded") if header.zstd_level else "off"),
        ("tokens", f"{pack.original_tokens:,} ({pack.sink_tokens:,} sink + "
                   f"{pack.original_tokens - pack.sink_tokens:,} context)"),
        ("entries kept", _kept(pack, stats)),
        *_budget_rows(stats),
        *_head_rows(meta, pack),
        ("source", f"{source.get('name', '?')} (sha256 {_short(source.get('sha256'))}, "
                   f"{source.get('chars', '?'):,} chars)" if isinstance(source.get("chars"), int)
                   else f"{source.get('name', '?')} (sha256 {_short(source.get('sha256'))})"),
    ]
    click.echo(_pairs(rows))

    kinds = meta.get("layer_kinds") or []
    click.echo("\nentries kept per layer (per KV head: min / mean / max)")
    layer_rows = []
    for l, layer in enumerate(pack.layers):
        hl = layer.head_lengths.double()
        layer_rows.append((str(l), kinds[l] if l < len(kinds) else "?", f"{layer.num_entries:,}",
                           f"{int(hl.min()):,}", f"{float(hl.mean()):,.1f}", f"{int(hl.max()):,}"))
    click.echo(_table(("layer", "kind", "entries", "min", "mean", "max"), layer_rows, right=(0, 2, 3, 4, 5),
                      indent="  "))
    errors = stats.get("quant_error")
    if isinstance(errors, list) and errors and all(isinstance(e, dict) for e in errors):
        click.echo("\nquantization error per layer (|dequantized - original| over all entries, KV units)")
        err_rows = [(str(e.get("layer", "?")), *(_num(e.get(k)) for k in (
            "key_max_abs", "key_mean_abs", "value_max_abs", "value_mean_abs")),
            _num(100 * e["quantized_fraction"]) + "%" if isinstance(e.get("quantized_fraction"), (int, float))
            else "?") for e in errors]
        click.echo(_table(("layer", "key max", "key mean", "value max", "value mean", "quantized"), err_rows,
                          right=(0, 1, 2, 3, 4, 5), indent="  "))

    click.echo("\nbytes by section")
    sections = header.bytes_by_section()
    sec_rows = [(name, f"{n:,}", f"{100 * n / max(1, header.file_bytes):.1f}%") for name, n in sections.items()]
    sec_rows.append(("total", f"{header.file_bytes:,}", "100.0%"))
    click.echo(_table(("section", "bytes", "share"), sec_rows, right=(1, 2), indent="  "))


def _num(x) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "?"


def _quantization(header, pack) -> str:
    """The ``quantization`` row of ``kvpack info``: type, group size, layout (compact: the key code widths)."""
    if not header.group_size:
        return "none"
    import torch

    head = f"{header.quant_type}, group size {header.group_size}"
    if header.quant_layout != C.QUANT_LAYOUT_COMPACT:
        return f"{head}, KIVI layout (keys per channel, values per token; sink and residual rows in full precision)"
    widths = torch.cat([l.quant.key_bits.reshape(-1) for l in pack.layers if l.quant is not None]).long()
    counts = torch.bincount(widths, minlength=C.MAX_KEY_BITS + 1)
    used = [(b, int(n)) for b, n in enumerate(counts.tolist()) if n]
    widths = "/".join(str(b) for b, _ in used)
    channels = "/".join(str(n) for _, n in used)
    return (f"{head}, compact layout (key code widths {widths} bits on {channels} channels of all heads; 8-bit "
            "group parameters; sink rows in full precision)")


def _kept(pack, stats: dict) -> str:
    total = f"{pack.kept_entries():,} stored"
    kept, entries = stats.get("context_entries_kept"), stats.get("context_entries")
    if isinstance(kept, int) and isinstance(entries, int) and entries:
        return f"{total}; context: {kept:,} of {entries:,} ({100 * kept / entries:.1f}%), sink always kept"
    return total


def _budget_rows(stats: dict) -> list[tuple[str, str]]:
    """``layer budgets`` (context entries kept per compressed layer) and D2O's ``merged`` line, when recorded."""
    rows = []
    budgets = stats.get("layer_budgets")
    if isinstance(budgets, list) and budgets:
        rows.append(("layer budgets", f"{', '.join(f'{b:,}' for b in budgets)} context entries "
                                      "(per compressed layer, sink not counted)"))
    merge = stats.get("merge")
    if isinstance(merge, dict):
        rows.append(("merged", f"{merge.get('merged', '?'):,} evicted entries merged into kept ones, "
                               f"{merge.get('dropped', '?'):,} dropped"
                     if all(isinstance(merge.get(k), int) for k in ("merged", "dropped")) else str(merge)))
    return rows


def _head_rows(meta: dict, pack) -> list[tuple[str, str]]:
    """kvzip-head: ``heads kept`` (how many (layer, KV head) pairs hold the whole context) and one row per
    compressed layer listing them; a head is kept when it holds every context token."""
    kinds = meta.get("layer_kinds") or []
    if meta.get("method") != "kvzip-head" or len(kinds) != len(pack.layers):
        return []
    context = pack.original_tokens - pack.sink_tokens
    rows, kept_n, total = [], 0, 0
    for l, layer in enumerate(pack.layers):
        if kinds[l] != "compressed":
            continue
        kept = [h for h, n in enumerate(layer.head_lengths.tolist()) if n - pack.sink_tokens == context]
        kept_n, total = kept_n + len(kept), total + len(layer.head_lengths)
        rows.append((f"  layer {l}", ", ".join(map(str, kept)) if kept else "none"))
    return [("heads kept", f"{kept_n} of {total} (layer, KV head) pairs hold the whole context; the others the "
                           "sink (and the window, if any)"), *rows]


def _short(digest) -> str:
    return f"{digest[:12]}..." if isinstance(digest, str) and len(digest) > 12 else str(digest or "-")


# ---------------------------------------------------------------------------------------------------------------
# verify


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH",
              help="Also check the pack fits this model (fingerprint and tokenizer).")
@_model_options
def verify(file, model_name, device, dtype):
    """Check a .kvpack file's integrity (and, with --model, that it fits the model)."""
    header = check_pack(file)
    click.echo(f"OK: {file} is intact (kvpack format v{header.format_version}, {header.file_bytes:,} bytes, "
               "all checksums match)")
    if model_name is not None:
        model, tokenizer = _load(model_name, device, dtype)
        check_compatible(header, model, tokenizer, path=str(file))
        click.echo(f"OK: {file} fits model {model_name} (architecture, weights and tokenizer match)")


# ---------------------------------------------------------------------------------------------------------------
# ask


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("question")
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH",
              help="The model the pack was built with [default: the embedded reference model].")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Longest answer, in tokens.")
@_model_options
def ask(file, question, model_name, max_new_tokens, device, dtype):
    """Answer QUESTION about the document compressed in FILE."""
    pack = load_pack(file)
    model, tokenizer = _load(model_name, device, dtype)
    cache = cache_from_pack(pack, model, tokenizer, where=str(file))
    click.echo(generate(model, tokenizer, cache, question, max_new_tokens=max_new_tokens))


# ---------------------------------------------------------------------------------------------------------------
# bench


def _csv(kind, name):
    """A click callback parsing a comma-separated list of ``kind`` (``None`` stays ``None``)."""
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            items = [kind(v.strip()) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {name}, got {value!r}") from None
        if not items:
            raise click.BadParameter(f"expected at least one {name}")
        return items
    return parse


@cli.command()
@click.option("--methods", callback=_csv(str, "method names"), metavar="M1,M2",
              help="kvpack methods, each a name or NAME[key=value;...] with its parameters, e.g. d2o[merge=values], "
                   "kvzip[scoring=plus], kvzip-head[heads=FILE] [default: all but kvzip-head: kvzip,d2o,"
                   "d2o[merge=values],d2o[merge=off],snapkv,pyramidkv,h2o,streaming,knorm,random; quick: "
                   "kvzip,streaming].")
@click.option("--ratios", callback=_csv(float, "ratios"), metavar="R1,R2",
              help="Fractions of KV entries kept [default: 1.0,0.5,0.3,0.2,0.1; quick: 1.0,0.3].")
@click.option("--quant", "quants", callback=_csv(str, "quantizations"), metavar="Q1,Q2",
              help="Storage of the kept KV: none,int8,int4 [default: none,int4; quick: none].")
@click.option("--lengths", callback=_csv(int, "token counts"), metavar="N1,N2",
              help="Needle context lengths in tokens [default: 1024,2048,4096; quick: 1024].")
@click.option("--trials", type=click.IntRange(min=1), default=None,
              help="Needle contexts per length and depth (depths 0, 10, ..., 100%) [default: 1].")
@click.option("--tasks", callback=_csv(str, "task names"), metavar="T1,T2",
              help="Which of needle,multiquery,continuation,speed,memory to run [default: all].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench-out", show_default=True,
              help="Folder for results.json, results.md and the PNG plots.")
@click.option("--quick", is_flag=True, help="A smoke run (about a minute on 2 cores); options above still apply.")
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH", help=_MODEL_HELP)
@click.option("--peer", type=click.Choice(["kvpress"]), default=None,
              help="Also run NVIDIA kvpress (KVzip, SnapKV, StreamingLLM presses) on the same contexts, in its own "
                   "virtual environment (made on first use; needs the package index).")
@click.option("--peer-venv", default=".venv-kvpress", show_default=True, metavar="DIR",
              help="The kvpress virtual environment.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds every context and question.")
@click.option("--device", type=click.Choice(_DEVICES), default="cpu", show_default=True, help="Where to run the model.")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="torch CPU threads (0: torch's default, which follows OMP_NUM_THREADS).")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots (no matplotlib needed).")
@click.pass_context
def bench(ctx, methods, ratios, quants, lengths, trials, tasks, out_dir, quick, model_name, peer, peer_venv, seed,
          device, threads, no_plots):
    """Benchmark methods x ratios x quantization on held-out text: needle retrieval, multi-query reuse,
    continuation NLL, speed, memory and file size; write JSON, Markdown and PNG plots to --out.

    Plots need matplotlib: pip install 'kvpack[bench]'.
    """
    from .bench import BenchConfig, run_bench

    given = {"methods": methods, "ratios": ratios, "quants": quants, "lengths": lengths, "trials": trials,
             "tasks": tasks}
    options = {k: v for k, v in given.items() if v is not None}
    options.update(model=model_name, peer=peer, peer_venv=peer_venv, seed=seed, device=device, threads=threads,
                   plots=not no_plots)
    cfg = BenchConfig.quick(**options) if quick else BenchConfig(**options)
    words = ["kvpack", "bench"]
    for p in ctx.command.params:
        if ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE:
            value = ctx.params[p.name]
            flag = p.opts[0]
            if p.is_flag:
                words.append(flag)
            else:
                words += [flag, ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in value)
                          if isinstance(value, list) else str(value)]
    run_bench(cfg, out_dir, command=" ".join(words), log=lambda m: click.echo(m, err=True))
    click.echo(f"results: {Path(out_dir) / 'results.md'}")


# ---------------------------------------------------------------------------------------------------------------
# formatting


def _pairs(rows) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _table(headers, rows, *, right=(), indent: str = "") -> str:
    cols = list(zip(headers, *rows))
    widths = [max(len(str(c)) for c in col) for col in cols]

    def line(cells):
        out = [f"{c:>{w}}" if i in right else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(out)).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def main() -> None:
    """Entry point of the ``kvpack`` console script and ``python -m kvpack``."""
    cli(prog_name="kvpack")
