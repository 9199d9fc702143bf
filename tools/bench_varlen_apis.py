#!/usr/bin/env python
"""What torch offers on CPU for per-head variable-length decode attention, timed side by side.

One decode token of one layer (``--heads`` query heads, ``--kv-heads`` KV heads, ``--head-dim``), float32, each KV
head keeping its own share of ``--keep x --tokens`` rows (fixed uneven shares), packed back to back:

* ``sdpa full (GQA)``: ``F.scaled_dot_product_attention(enable_gqa=True)`` over the full ``--tokens`` KV (what a
  plain transformers decode step runs), the baseline;
* ``flash full, GQA folded``: the fused CPU flash kernel over the full KV with each group's queries folded into
  one block (no key copies);
* ``per-head flash``: the packed rows, one flash call per KV head (``kvpack.varlen``'s CPU path);
* ``per-head products``: the packed rows, per head ``softmax(q K^T) V`` with matmuls;
* ``nested jagged SDPA``: ``torch.nested`` jagged tensors (batch = KV heads) through SDPA;
* ``flex_attention (compiled)``: one packed sequence with a per-head block mask, ``torch.compile``d (compile
  time printed apart; needs a C++ compiler);
* ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn``, when it runs on CPU (it did not in torch 2.13).

Medians of ``--repeats`` interleaved rounds.

    python tools/bench_varlen_apis.py --tokens 32768 --repeats 9 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--keep", type=float, default=0.3)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-flex", action="store_true", help="skip flex_attention (its compile takes a while)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g0 = torch.Generator().manual_seed(0)
    H, hkv, D, N = args.heads, args.kv_heads, args.head_dim, args.tokens
    g = H // hkv
    shares = torch.linspace(0.4, 1.6, hkv)
    lens = [min(N, int(x)) for x in (shares / shares.sum() * args.keep * hkv * N).tolist()]
    total = sum(lens)
    off = [0]
    for n in lens:
        off.append(off[-1] + n)
    K, V = torch.randn(total, D, generator=g0), torch.randn(total, D, generator=g0)
    q = torch.randn(1, H, 1, D, generator=g0)
    kf, vf = torch.randn(1, hkv, N, D, generator=g0), torch.randn(1, hkv, N, D, generator=g0)
    scale = D ** -0.5
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    heads = [(K[a:b][None, None], V[a:b][None, None]) for a, b in zip(off, off[1:])]

    def per_head_flash():
        return [flash(q[:, h * g:(h + 1) * g].reshape(1, 1, g, D), k, v, scale=scale) for h, (k, v) in
                enumerate(heads)]

    def per_head_products():
        return [torch.softmax(q[0, h * g:(h + 1) * g, 0] @ k[0, 0].T * scale, -1) @ v[0, 0]
                for h, (k, v) in enumerate(heads)]

    offsets = torch.tensor(off)
    qj_offsets = torch.arange(0, H + 1, g)

    def nested():
        kj = torch.nested.nested_tensor_from_jagged(K.view(total, 1, D), offsets).transpose(1, 2)
        vj = torch.nested.nested_tensor_from_jagged(V.view(total, 1, D), offsets).transpose(1, 2)
        qj = torch.nested.nested_tensor_from_jagged(q[0, :, 0].reshape(H, 1, D), qj_offsets).transpose(1, 2)
        return F.scaled_dot_product_attention(qj, kj, vj, scale=scale)

    fns = {"sdpa full (GQA)": lambda: F.scaled_dot_product_attention(q, kf, vf, scale=scale, enable_gqa=True),
           "flash full, GQA folded": lambda: flash(q.view(1, hkv, g, D), kf, vf, scale=scale),
           "per-head flash": per_head_flash, "per-head products": per_head_products, "nested jagged SDPA": nested}
    notes = []
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            head_of_row = torch.repeat_interleave(torch.arange(hkv), torch.tensor(lens))
            head_of_query = torch.arange(hkv).repeat_interleave(g)
            mask = create_block_mask(lambda b, h, qi, ki: head_of_query[qi] == head_of_row[ki], 1, 1, H, total,
                                     device="cpu")
            compiled = torch.compile(flex_attention)
            t0 = time.perf_counter()
            compiled(q[0, :, 0][None, None], K[None, None], V[None, None], block_mask=mask, scale=scale)
            notes.append(f"flex_attention compile + first call: {time.perf_counter() - t0:.1f} s")
            fns["flex_attention (compiled)"] = lambda: compiled(q[0, :, 0][None, None], K[None, None],
                                                                V[None, None], block_mask=mask, scale=scale)
        except Exception as e:  # noqa: BLE001 - no compiler, or unsupported here
            notes.append(f"flex_attention: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
    try:
        from torch.nn.attention.varlen import varlen_attn

        cu_q = torch.arange(0, H + 1, g, dtype=torch.int32)
        varlen_attn(q[0, :, 0].reshape(H, 1, D), K.view(total, 1, D), V.view(total, 1, D), cu_q,
                    offsets.int(), g, max(lens))
        fns["varlen_attn"] = lambda: varlen_attn(q[0, :, 0].reshape(H, 1, D), K.view(total, 1, D),
                                                 V.view(total, 1, D), cu_q, offsets.int(), g, max(lens))
    except Exception as e:  # noqa: BLE001
        notes.append(f"varlen_attn: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
    times = {k: [] for k in fns}
    for r in range(args.repeats + 1):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["sdpa full (GQA)"])
    print(f"{H} query / {hkv} KV heads, head dim {D}, {N} tokens, keep {args.keep} (rows per head {lens}), "
          f"float32, {torch.get_num_threads()} threads, torch {torch.__version__}; medians of {args.repeats}\n")
    print("| path | median ms | vs sdpa full |\n|---|---:|---:|")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"| {k} | {m * 1e3:.2f} | {m / base:.2f}x |")
    for n in notes:
        print(f"\n{n}")


if __name__ == "__main__":
    main()
