"""Speed, memory and size, each as a ratio measured in the same run.

* Build vs plain prefill: ``kvpack.compress`` of one context per method against one plain transformers forward
  of the same tokens into a ``DynamicCache`` (the cost of using the document uncompressed). KVzip's build is about
  2-3 prefills by design (arXiv 2505.23416 §3.2: one prefill plus a chunked reconstruction pass).
* Load vs re-prefill: ``kvpack.load`` of the saved file against that plain prefill (what reuse saves).
* Decode step: one token forward over the loaded cache against one over the full ``DynamicCache`` (medians).
* Peak memory of a build at several lengths, each in a fresh process (``kvpack.bench.memory``), to show it grows
  linearly in the context length (chunked prefill and scoring; ``kvpack.prefill``).
* File bytes per context token of each method's pack.

Runs are interleaved (prefill, then every method's build, repeated) so machine noise hits every row alike; the
tables give medians.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import settings as S
from ..attention import use_kvpack_attention
from ..compress import compress
from ..fileformat import save
from ..layout import chat_layout
from ..loading import load
from ..model import model_spec
from .specs import parse_method_spec

#: The folder holding the ``kvpack`` package this process imported (put first on a subprocess's PYTHONPATH).
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

__all__ = ["needle_context_ids", "measure_speed", "measure_memory", "linear_growth", "timed", "plain_prefill",
           "causal_attention_alone"]


def needle_context_ids(tokenizer, tokens: int, device) -> tuple[str, torch.Tensor]:
    """A needle haystack of about ``tokens`` tokens (one random fact at 50% depth, seed 0; ``kvpack.tasks``) and
    its cached sequence's ids ``[1, prefix + context tokens]`` on ``device``: the benchmarks' context."""
    import random

    from .. import tasks

    rng = random.Random(0)
    layout = chat_layout(tokenizer)
    text = tasks.needle_context(tokenizer, tokens, [tasks.random_fact(rng)], [0.5], rng)
    return text, torch.tensor([layout.prefix_ids(tokenizer) + layout.encode(tokenizer, text)], device=device)


def timed(fn):
    """``(seconds, fn())``, synchronising CUDA before the clock stops."""
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


@torch.inference_mode()
def plain_prefill(model, ids: torch.Tensor):
    """Plain transformers: SDPA attention, one forward of ``ids`` (``[1, tokens]``) into a ``DynamicCache``, the
    baseline every build and load time is compared with (``kvpack.load`` switches the model back)."""
    from transformers import DynamicCache

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def causal_attention_alone(model, tokens: int):
    """A callable that runs only the attention part of a plain prefill of ``tokens`` tokens: one causal SDPA call
    (GQA) per layer on random ``[1, heads, tokens, head_dim]`` queries and ``[1, kv_heads, tokens, head_dim]``
    keys/values of the model's shape and dtype (made here, not inside the callable). Timing it against
    ``plain_prefill`` gives the share of prefill time spent in attention."""
    spec = model_spec(model)
    q = torch.randn(1, spec.num_heads, tokens, spec.head_dim, dtype=model.dtype, device=model.device)
    kv = torch.randn(1, spec.num_kv_heads, tokens, spec.head_dim, dtype=model.dtype, device=model.device)

    @torch.inference_mode()
    def run() -> None:
        for _ in range(model.config.num_hidden_layers):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)

    return run


@torch.inference_mode()
def _decode_step_s(model, cache, steps: int, rewind, token: torch.Tensor) -> float:
    """Median seconds of one forward of ``token`` (``[1, 1]``) over ``cache`` (``rewind`` restores it after each
    step)."""
    times = []
    for _ in range(steps):
        t, _ = timed(lambda: model(input_ids=token, past_key_values=cache, use_cache=True))
        rewind()
        times.append(t)
    return statistics.median(times)


def _drop_tail(cache, tokens: int) -> None:
    """Cut a ``DynamicCache`` back to its first ``tokens`` tokens (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - tokens
    if extra > 0:
        cache.crop(-extra)


def measure_speed(model, tokenizer, text: str, methods: list[str], ratio: float, folder, *, repeats: int = 2,
                  chunk_size: int = 2048, zstd_level: int = S.DEFAULT_ZSTD_LEVEL, decode_steps: int = 16,
                  log=None) -> dict:
    """Build, load and decode timings of ``methods`` at ``ratio`` for one context, against plain prefill.

    Args:
        text: the context (its token count is reported as ``tokens``).
        methods: method names or specs (``d2o[merge=values]``, ``kvpack.bench.specs``); ``none`` is built at 1.0.
        ratio: fraction kept for the other methods.
        folder: where the packs are written (then removed).
        repeats: interleaved rounds; medians are reported.
        decode_steps: single-token forwards timed per cache.

    Returns:
        ``{"tokens", "ratio", "repeats", "prefill_s", "build_s": {m: s}, "build_vs_prefill": {m: x},
        "save_s": {m: s}, "load_s": {m: s}, "load_speedup_vs_prefill": {m: x}, "file_bytes": {m: bytes},
        "bytes_per_token": {m: bytes/token}, "decode_full_s", "decode_loaded_s": {m: s},
        "decode_vs_full": {m: x}}`` (seconds are medians; ``x`` ratios are method / prefill or loaded / full,
        except ``load_speedup_vs_prefill`` = prefill / load).
    """
    layout = chat_layout(tokenizer)
    ids = torch.tensor([layout.prefix_ids(tokenizer) + layout.encode_text(tokenizer, text)], device=model.device)
    tokens = int(ids.shape[1])
    rows: dict[str, list[float]] = {"prefill": []}
    build = {m: [] for m in methods}
    saves = {m: [] for m in methods}
    loads = {m: [] for m in methods}
    nbytes: dict[str, int] = {}
    caches = {}
    plain_prefill(model, ids)  # warm-up
    for rep in range(repeats):
        rows["prefill"].append(timed(lambda: plain_prefill(model, ids))[0])
        for m in methods:
            r = 1.0 if m == "none" else ratio
            name, options = parse_method_spec(m)
            t, pack = timed(lambda: compress(model, tokenizer, text, method=name, ratio=r, chunk_size=chunk_size,
                                             **options))
            build[m].append(t)
            path = os.path.join(os.fspath(folder), f"speed-{methods.index(m)}.kvpack")  # specs may hold paths
            t, n = timed(lambda: save(pack, path, zstd_level=zstd_level))
            saves[m].append(t)
            nbytes[m] = int(n)
            t, cache = timed(lambda: load(path, model, tokenizer=tokenizer))
            loads[m].append(t)
            os.remove(path)
            caches[m] = cache
            if log:
                log(f"  speed round {rep + 1}/{repeats}: {m} build {build[m][-1]:.2f} s, load {loads[m][-1]:.3f} s")
    prefill_s = statistics.median(rows["prefill"])
    full_cache = plain_prefill(model, ids)
    token = ids[:, -1:]
    decode_full = _decode_step_s(model, full_cache, decode_steps, lambda: _drop_tail(full_cache, tokens), token)
    use_kvpack_attention(model)  # a loaded cache needs kvpack's per-head masking (kvpack.load had set it)
    decode_loaded = {m: _decode_step_s(model, c, decode_steps, c.rewind, token) for m, c in caches.items()}
    med = lambda d: {m: statistics.median(v) for m, v in d.items()}  # noqa: E731
    build_s, load_s = med(build), med(loads)
    return {"tokens": tokens, "ratio": ratio, "repeats": repeats, "prefill_s": prefill_s, "build_s": build_s,
            "build_vs_prefill": {m: s / prefill_s for m, s in build_s.items()}, "save_s": med(saves),
            "load_s": load_s, "load_speedup_vs_prefill": {m: prefill_s / s for m, s in load_s.items()},
            "file_bytes": nbytes, "bytes_per_token": {m: n / tokens for m, n in nbytes.items()},
            "decode_full_s": decode_full, "decode_loaded_s": decode_loaded,
            "decode_vs_full": {m: s / decode_full for m, s in decode_loaded.items()}}


def measure_memory(lengths: list[int], method: str, ratio: float, *, model: str | None = None,
                   chunk_size: int = 2048, threads: int = 1, timeout_s: float = 900.0, log=None) -> list[dict]:
    """Peak resident memory of one ``kvpack.compress`` per length, each in a fresh process.

    Each length runs ``python -m kvpack.bench.memory`` (see that module): the process loads the model, makes the
    context, resets its peak-RSS counter, builds, and reports the peak growth in bytes. A length beyond the model's
    ``max_position_embeddings`` (minus 256 tokens for questions) is allowed for this measurement only (the model's
    limit is raised in that process; answers at such lengths are not meaningful), and the row says so.

    Returns:
        ``[{"tokens", "method", "ratio", "baseline_bytes", "peak_bytes", "growth_bytes", "build_s",
        "extended_positions", "peak_method"}]``, or ``{"tokens", "error"}`` rows for lengths that failed.
    """
    out = []
    for n in lengths:
        # -P: the working folder is not put on sys.path (a checkout named kvpack there would shadow the package);
        # PYTHONPATH leads to the kvpack this process runs
        cmd = [sys.executable, "-P", "-m", "kvpack.bench.memory", "--tokens", str(n), "--method", method, "--ratio",
               str(ratio), "--chunk-size", str(chunk_size)]
        if model is not None:
            cmd += ["--model", str(Path(model).resolve()) if Path(model).exists() else str(model)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
            [_PACKAGE_ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            out.append({"tokens": n, "error": f"timed out after {timeout_s:.0f} s"})
            continue
        lines = [l for l in res.stdout.splitlines() if l.startswith("{")]
        if res.returncode != 0 or not lines:
            out.append({"tokens": n, "error": (res.stderr.strip().splitlines() or ["no output"])[-1]})
        else:
            out.append(json.loads(lines[-1]))
        if log:
            row = out[-1]
            log(f"  memory {n} tokens: " + (row.get("error") or
                                             f"+{row['growth_bytes'] / 2**20:.1f} MiB in {row['build_s']:.1f} s"))
    return out


def linear_growth(memory_rows: list[dict]) -> dict | None:
    """Whether the build's peak memory grows at most linearly: ``growth(longest) / growth(second longest)``
    against ``tokens(longest) / tokens(second longest)``.

    Returns ``{"from_tokens", "to_tokens", "token_ratio", "growth_ratio", "linear"}`` (``linear``: the growth
    ratio is at most 1.25 x the token ratio), or ``None`` with fewer than two successful lengths.
    """
    ok = sorted((r for r in memory_rows if "error" not in r and r.get("growth_bytes", 0) > 0),
                key=lambda r: r["tokens"])
    if len(ok) < 2:
        return None
    a, b = ok[-2], ok[-1]
    token_ratio = b["tokens"] / a["tokens"]
    growth_ratio = b["growth_bytes"] / a["growth_bytes"]
    return {"from_tokens": a["tokens"], "to_tokens": b["tokens"], "token_ratio": token_ratio,
            "growth_ratio": growth_ratio, "linear": growth_ratio <= 1.25 * token_ratio}
