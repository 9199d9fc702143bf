#!/usr/bin/env python
"""Time one layer's attention paths at a model's shapes, side by side: what H2O/D2O's column sums and KVzip's
repeat-pass scores cost on top of the attention itself.

Random float32 queries, keys and values of the model's shape (query heads, KV heads, head_dim) for one layer:

* prefill (the chunks of a ``--tokens`` context in ``--chunk-size`` pieces, each over the keys before it):
  ``flash``: the fused CPU flash kernel (output and log-sum-exp) alone, the baseline;
  ``flash + transposed flash``: column sums from a second flash call on the transposed problem
  (``kvpack.stats.column_sums``, the path other devices and dtypes keep);
  ``one pass``: output and column sums from the same blocked probabilities (``kvpack.stats.attention_with_column_sums``).
* KVzip repeat pass (one chunk's repeat input, ``--chunk-size`` + ``--repeat-extra`` queries, over the sink, the
  chunk's entries and its own keys causally):
  ``flash + scores``: two flash calls and one more product for the max-probability scores
  (``kvpack.attention._scored_attention_flash``);
  ``one pass``: output and scores from the same blocked probabilities (``kvpack.stats.one_pass_attention``);
  ``one pass + context``: the same, also filling Attention Matching's ``ContextAttention`` over the chunk's entries
  (each query's output and log-sum-exp there, the squared probabilities per entry: what the RMS selection takes).
* D2O's merge search for one KV head (``round((1 - ratio) x tokens)`` evicted keys against the
  ``round(ratio x tokens)`` kept ones, cosine similarity): the similarity product alone (with its GFLOP/s), the
  product with ``max(dim=1)``, and ``kvpack.methods.d2o.nearest_kept`` (product and two-stage argmax).

``--threads`` sets torch's thread count (default: torch's own).

Runs are interleaved, ``--repeats`` times; the table gives medians and each path's ratio to its baseline.

    python tools/bench_attention.py --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpack  # noqa: E402
from kvpack.attention import _scored_attention_flash, attention_with_lse  # noqa: E402
from kvpack.model import model_spec  # noqa: E402
from kvpack.methods.d2o import nearest_kept  # noqa: E402
from kvpack.stats import ContextAttention, attention_with_column_sums, column_sums, one_pass_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder whose shapes to use (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=4101, help="context tokens of the prefill (template included)")
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--repeat-extra", type=int, default=20, help="repeat-input tokens beyond the chunk's own")
    ap.add_argument("--sink", type=int, default=5, help="attention-sink entries the repeat pass also sees")
    ap.add_argument("--ratio", type=float, default=0.3, help="D2O merge search: fraction of the context kept")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    model, _ = kvpack.load_model(args.model, device="cpu")
    spec = model_spec(model)
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    scaling = dim**-0.5
    torch.manual_seed(0)
    q_all = torch.randn(1, heads, args.tokens, dim)
    k_all, v_all = torch.randn(2, 1, kv_heads, args.tokens, dim).unbind(0)
    chunks = [(s, min(args.tokens, s + args.chunk_size)) for s in range(0, args.tokens, args.chunk_size)]

    def prefill_flash():
        for s, e in chunks:
            attention_with_lse(q_all[:, :, s:e], k_all[:, :, :e], v_all[:, :, :e], scaling)

    def prefill_two_flash():
        for s, e in chunks:
            _, lse = attention_with_lse(q_all[:, :, s:e], k_all[:, :, :e], v_all[:, :, :e], scaling)
            column_sums(q_all[:, :, s:e], k_all[:, :, :e], lse, scaling)

    def prefill_one_pass():
        for s, e in chunks:
            attention_with_column_sums(q_all[:, :, s:e], k_all[:, :, :e], v_all[:, :, :e], scaling)

    q_len, past = args.chunk_size + args.repeat_extra, args.sink + args.chunk_size
    q_rep = torch.randn(1, heads, q_len, dim)
    k_rep, v_rep = torch.randn(2, 1, kv_heads, past + q_len, dim).unbind(0)

    def repeat_flash():
        _scored_attention_flash(q_rep, k_rep, v_rep, past, scaling, torch.zeros(kv_heads, past))

    def repeat_one_pass():
        one_pass_attention(q_rep, k_rep, v_rep, scaling, max_scores=torch.zeros(kv_heads, past))

    def repeat_one_pass_context():
        one_pass_attention(q_rep, k_rep, v_rep, scaling, max_scores=torch.zeros(kv_heads, past),
                           context=ContextAttention(args.sink, past))

    kept_n = round(args.ratio * args.tokens)
    evicted_k = torch.randn(args.tokens - kept_n, dim)
    kept_k = torch.randn(kept_n, dim)
    unit_e = torch.nn.functional.normalize(evicted_k, dim=-1)
    unit_k = torch.nn.functional.normalize(kept_k, dim=-1).T.contiguous()

    def merge_product():
        unit_e @ unit_k

    def merge_max():
        (unit_e @ unit_k).max(dim=1)

    def merge_nearest():
        nearest_kept(evicted_k, kept_k)

    rows = {"prefill: flash (output + log-sum-exp)": prefill_flash,
            "prefill: flash + transposed flash (column sums)": prefill_two_flash,
            "prefill: one pass (output + column sums)": prefill_one_pass,
            "KVzip repeat: flash + score product": repeat_flash,
            "KVzip repeat: one pass (output + scores)": repeat_one_pass,
            "KVzip repeat: one pass + context (AM's RMS selection)": repeat_one_pass_context,
            "D2O merge search: similarity product alone": merge_product,
            "D2O merge search: product + max(dim=1)": merge_max,
            "D2O merge search: nearest_kept (two-stage argmax)": merge_nearest}
    times = {name: [] for name in rows}
    with torch.inference_mode():
        for fn in rows.values():
            fn()  # warm-up
        for _ in range(args.repeats):
            for name, fn in rows.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"one layer of {getattr(model, 'kvpack_name', args.model)}: {heads} query / {kv_heads} KV heads, head_dim "
          f"{dim}, float32, {torch.get_num_threads()} torch threads; prefill {args.tokens} tokens in chunks of "
          f"{args.chunk_size}; repeat {q_len} queries over {past} entries + their own; D2O merge search "
          f"{args.tokens - kept_n} evicted x {kept_n} kept keys (one KV head); medians of {args.repeats}")
    print("| path | median ms | ratio |")
    print("|---|---|---|")
    baselines = {"prefill": "prefill: flash (output + log-sum-exp)", "KVzip": "KVzip repeat: flash + score product",
                 "D2O": "D2O merge search: similarity product alone"}
    for name in rows:
        base = med[baselines[name.split(" ")[0].rstrip(":")]]
        print(f"| {name} | {med[name] * 1e3:.2f} | {med[name] / base:.2f}x |")
    flops = 2 * (args.tokens - kept_n) * kept_n * dim
    print(f"similarity product: {flops / 1e6:.0f} MFLOP in {med['D2O merge search: similarity product alone'] * 1e3:.2f} ms"
          f" = {flops / med['D2O merge search: similarity product alone'] / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
