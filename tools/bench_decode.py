"""Decode-step benchmark: full-cache SDPA against kernels.varlen_decode on per-head variable-length KV.

One layer of an 8B-shaped model (32 query heads, 8 KV heads, head dim 128; `--model DIR` takes the shape of a
model folder instead), batch 1, one new token:
  sdpa-full      torch SDPA over the full `--tokens` KV in bf16 (GQA via enable_gqa), each backend that
                 accepts it (flash, efficient, cudnn) and the default choice; the fastest is the baseline
  ours-full      our kernel over the same full KV (same bytes as SDPA: kernel efficiency alone)
  ours-keep      our kernel, bf16, random non-uniform per-head budgets summing to keep * Hkv * tokens
  ours-keep-int4 the same budgets, each head's rows in int4 (KIVI layout, G = --group-size) except the
                 last budget % G rows, which stay bf16 (residual), plus the current token in the tail
  ours-keep-compact-int4  (CUDA) kernels.compact_decode_triton over the ours-keep rows in format v5's compact
                 int4 layout (kvpack.quant.quantize_pack), codes and 8-bit parameters read as stored
  packed-cache   the path kvpack's loaded cache takes (kvpack.varlen.packed_attention over a PackedLayer of
                 the ours-keep rows): the Triton kernel on CUDA, per-head fused flash calls on CPU
  packed-cache-full  the same path over the full KV (every head all --tokens rows): the ratio of packed-cache
                 to it is the keep ratio's own gain, without the gain of the path over SDPA
  masked-padded  what the loaded cache did before: every head padded to the longest, masked SDPA (GQA)
GPU timings: CUDA events around one call, the L2 flushed before each (so the cache is read from HBM, as in
a real multi-layer decode step), median over --reps. Prints a Markdown table (with the command line and
versions) and writes it, plus JSON, to $OUT (or --out) when set.

    python tools/bench_decode.py                         # CUDA, 32K tokens (tools/gpu_check.sh)
    python tools/bench_decode.py --device cpu --dtype float32 --tokens 32768 --reps 15 --no-reference
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpack import kernels  # noqa: E402
from kvpack.kernels import reference as ref  # noqa: E402
from kvpack.varlen import _packed_attention_torch, packed_attention  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--keep", type=float, default=0.3)
    p.add_argument("--model", default=None,
                   help="model folder whose attention shape to use (overrides --heads/--kv-heads/--head-dim)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group-size", type=int, default=64, help="int4 group size G (32, 64 or 128)")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default: torch's own)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the ours-* rows of the reference path (CPU: slow, a per-head concatenation)")
    p.add_argument("--sweep", action="store_true", help="also time launch configurations of our kernel (CUDA)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for bench_decode.md/.json (default $OUT)")
    args = p.parse_args(argv)
    if args.model is not None:  # e.g. a tools/make_shape_model.py folder: one layer of that model's shape
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(args.model, local_files_only=True)
        args.heads = cfg.num_attention_heads
        args.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        args.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return args


def versions(device):
    try:
        import triton
        tv = triton.__version__
    except Exception as e:  # noqa: BLE001
        tv = f"not importable ({type(e).__name__}: {e})"
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": tv, "device": gpu,
            "cuda": torch.version.cuda}


def fail_fast(device):
    if device != "cuda":
        return
    if not torch.cuda.is_available():
        sys.exit(f"error: --device cuda but torch {torch.__version__} sees no GPU (CUDA build: {torch.version.cuda}); "
                 "use --device cpu for the reference-path smoke test")
    if not kernels.HAS_TRITON:
        sys.exit("error: triton is not importable, so the kernel cannot run on the GPU")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("error: TRITON_INTERPRET=1 is set; unset it to time the compiled kernel")


def budgets(hkv, tokens, keep, gen):
    """Random non-uniform per-head row counts (log-normal weights), each <= tokens, summing to keep*hkv*tokens."""
    total = round(keep * hkv * tokens)
    w = torch.exp(torch.randn(hkv, generator=gen))
    b = torch.minimum((w / w.sum() * total).floor().long(), torch.tensor(tokens))
    while int(b.sum()) < total:  # hand the rounding/capping remainder to heads with room
        room = (b < tokens).nonzero().flatten()
        b[room[int(torch.randint(len(room), (1,), generator=gen))]] += 1
    return b.tolist()


def build(args, dev):
    gen = torch.Generator().manual_seed(args.seed)
    H, hkv, D, N, G = args.heads, args.kv_heads, args.head_dim, args.tokens, args.group_size
    bf = getattr(torch, args.dtype)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(bf).to(dev)

    q = rnd(H, D)
    k_full, v_full = rnd(hkv, N, D), rnd(hkv, N, D)  # the current token is the last row
    scale = D ** -0.5
    tail_k, tail_v = k_full[:, N - 1:], v_full[:, N - 1:]  # (Hkv, 1, D)

    def varlen(lens):
        off = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        fk = torch.cat([k_full[h, :n] for h, n in enumerate(lens)])
        fv = torch.cat([v_full[h, :n] for h, n in enumerate(lens)])
        return fk, fv, off

    case = {}
    fk, fv, off = varlen([N - 1] * hkv)
    case["ours-full"] = dict(q=q, fp_keys=fk, fp_values=fv, fp_offsets=off, tail_keys=tail_k, tail_values=tail_v,
                             scale=scale)
    b = budgets(hkv, N - 1, args.keep, gen)
    fk, fv, off = varlen(b)
    case["ours-keep"] = dict(case["ours-full"], fp_keys=fk, fp_values=fv, fp_offsets=off)
    nq = [n // G * G for n in b]
    fk, fv, off = varlen([n - m for n, m in zip(b, nq)])  # residual rows, bf16
    qk = torch.cat([k_full[h, N - 1 - m:N - 1] for h, m in enumerate(nq)])  # int4 rows
    qv = torch.cat([v_full[h, N - 1 - m:N - 1] for h, m in enumerate(nq)])
    kc, ks, km = ref.quantize_int4_keys(qk, G)
    vc, vs, vm = ref.quantize_int4_values(qv, G)
    q_off = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    case["ours-keep-int4"] = dict(case["ours-full"], fp_keys=fk, fp_values=fv, fp_offsets=off,
                                  key_codes=kc, key_scales=ks, key_mins=km, value_codes=vc, value_scales=vs,
                                  value_mins=vm, q_offsets=q_off, group_size=G)
    return q, k_full, v_full, scale, case, b


def packed_layer(a, tokens):
    """A kvpack ``PackedLayer`` holding case ``a``'s rows (offsets, the one-token tail), and the same rows padded
    per head to the longest with a ``[1, H, 1, longest + 1]`` visibility mask (the loaded cache's old layout)."""
    from kvpack.cache import PackedLayer

    off = a["fp_offsets"].tolist()
    lengths = [e - s for s, e in zip(off, off[1:])]
    layer = PackedLayer(a["fp_keys"], a["fp_values"], torch.zeros(off[-1], dtype=torch.long, device=a["q"].device),
                        lengths, tokens - 1)
    layer.update(a["tail_keys"][None], a["tail_values"][None])
    hkv, m = len(lengths), max(lengths)
    d = a["fp_keys"].shape[1]
    pk = a["fp_keys"].new_zeros(1, hkv, m + 1, d)
    pv = a["fp_values"].new_zeros(1, hkv, m + 1, d)
    mask = torch.zeros(1, hkv, 1, m + 1, dtype=torch.bool, device=pk.device)
    for h, n in enumerate(lengths):
        pk[0, h, :n], pv[0, h, :n] = a["fp_keys"][off[h]:off[h + 1]], a["fp_values"][off[h]:off[h + 1]]
        mask[0, h, 0, :n] = True
    pk[0, :, m], pv[0, :, m], mask[0, :, 0, m] = a["tail_keys"][:, 0], a["tail_values"][:, 0], True
    group = a["q"].shape[0] // hkv
    return layer, (pk, pv, mask.repeat_interleave(group, dim=1))


def compact_case(a, group_size):
    """``kernels.compact_decode_triton``'s arguments for case ``a``'s rows quantized to int4 in the compact layout
    (``kvpack.quant.quantize_pack``, uniform key widths, no sink), plus ``q`` and ``scale``."""
    from kvpack.pack import LayerEntries, Pack
    from kvpack.quant import quantize_pack
    from kvpack.compact_cache import compact_kernel_args

    off = a["fp_offsets"].tolist()
    lengths = [e - s for s, e in zip(off, off[1:])]
    positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    layer = LayerEntries(a["fp_keys"].float().cpu(), a["fp_values"].float().cpu(), positions, torch.tensor(lengths))
    q = quantize_pack(Pack(torch.arange(max(lengths) + 1), [layer], 0, {}), "int4", group_size, "compact")
    args = compact_kernel_args(q.layers[0], a["q"].dtype, a["q"].device)
    return dict(args, q=a["q"], scale=a["scale"])


def kv_bytes(a):
    keys = ("fp_keys", "fp_values", "tail_keys", "tail_values", "key_codes", "key_scales", "key_mins",
            "value_codes", "value_scales", "value_mins")
    return sum(a[k].numel() * a[k].element_size() for k in keys if k in a)


def timer(dev, reps, warmup):
    """-> run(fn): per-call microseconds. CUDA: events around each call with the L2 flushed before it."""
    if dev == "cuda":
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)  # > 4x the 60 MB L2

        def run(fn):
            for _ in range(warmup):
                fn()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            for s, e in zip(starts, ends):
                flush.zero_()
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    else:
        def run(fn):
            for _ in range(warmup):
                fn()
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e6)
            return out
    return run


def as_graph(fn):
    """Capture fn (already warmed up) in a CUDA graph and return its replay: GPU time without Python/launch
    overhead. None where capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as e:  # noqa: BLE001
        print(f"# CUDA graph capture failed ({type(e).__name__}: {str(e)[:200]}); eager timing only")
        return None


def main(argv=None):
    args = parse_args(argv)
    fail_fast(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dev = args.device
    info = versions(dev)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    print(f"# {cmd}\n# " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    backend = "triton" if dev == "cuda" else "reference"
    H, hkv, D, N = args.heads, args.kv_heads, args.head_dim, args.tokens
    q, k_full, v_full, scale, case, b = build(args, dev)
    print(f"# per-head budgets (keep {args.keep}): {b}", flush=True)

    q4 = q.view(1, H, 1, D)
    kf, vf = k_full[None], v_full[None]  # (1, Hkv, N, D)
    sdpas = {}  # label -> fn; on CUDA each SDPA backend that accepts the call, the fastest is the baseline
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                    ("cudnn", SDPBackend.CUDNN_ATTENTION)] if dev == "cuda" else []
    except ImportError:
        backends = []

    def sdpa_fn(backend=None):
        def fn():
            if backend is None:
                return F.scaled_dot_product_attention(q4, kf, vf, scale=scale, enable_gqa=True)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, kf, vf, scale=scale, enable_gqa=True)
        return fn

    for label, backend in backends:
        try:
            sdpa_fn(backend)()
            sdpas[f"sdpa-full [{label}]"] = sdpa_fn(backend)
        except Exception as e:  # noqa: BLE001 - backend refuses this shape/dtype/GQA
            print(f"# SDPA backend {label} unavailable here: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    sdpas["sdpa-full [default]"] = sdpa_fn()
    expected_full = sdpas["sdpa-full [default]"]().view(H, D).float()

    run = timer(dev, args.reps, args.warmup)
    rows = []

    pending = []

    def measure(variant, fn, n_rows, nbytes, err):
        pending.append((variant, fn, n_rows, nbytes, err))

    def timed_all():
        """CUDA: each variant's calls in a row (events, graph replay). CPU: interleaved rounds, one call of each
        variant per round, so that the shared machine's load falls on all of them alike."""
        if dev == "cpu":
            for _ in range(args.warmup):
                for p in pending:
                    p[1]()
            times = {p[0]: [] for p in pending}
            for _ in range(args.reps):
                for variant, fn, *_ in pending:
                    t0 = time.perf_counter()
                    fn()
                    times[variant].append((time.perf_counter() - t0) * 1e6)
        for variant, fn, n_rows, nbytes, err in pending:
            eager = times[variant] if dev == "cpu" else run(fn)
            replay = as_graph(fn) if dev == "cuda" else None
            graph = run(replay) if replay else None
            rows.append(dict(variant=variant, rows=n_rows, bytes=nbytes, err=err, eager_us=statistics.median(eager),
                             graph_us=statistics.median(graph) if graph else None, min_us=min(graph or eager)))
            print(f"# {variant}: eager {rows[-1]['eager_us']:.1f} us, graph {rows[-1]['graph_us']} us", flush=True)

    for label, fn in sdpas.items():
        measure(label, fn, hkv * N, 2 * kf.numel() * kf.element_size(), 0.0)
    layer, padded = packed_layer(case["ours-keep"], N)
    q_cache = q.view(1, H, 1, D)
    out = packed_attention(q_cache, layer, scale).view(H, D).float()
    err = (out - kernels.varlen_decode_reference(**case["ours-keep"]).float()).abs().max().item()
    measure("packed-cache", lambda: packed_attention(q_cache, layer, scale), layer.kept_keys.shape[0] + hkv,
            kv_bytes(case["ours-keep"]), err)
    if dev == "cpu":  # the cache's other CPU path (sliding windows), per-head products instead of flash calls
        measure("packed-cache [products]", lambda: _packed_attention_torch(q_cache, layer, scale, None),
                layer.kept_keys.shape[0] + hkv, kv_bytes(case["ours-keep"]), err)
    full_layer, _ = packed_layer(case["ours-full"], N)
    measure("packed-cache-full", lambda: packed_attention(q_cache, full_layer, scale), hkv * N,
            kv_bytes(case["ours-full"]), (packed_attention(q_cache, full_layer, scale).view(H, D).float()
                                          - expected_full).abs().max().item())
    pk, pv, pmask = padded
    measure("masked-padded", lambda: F.scaled_dot_product_attention(q4, pk, pv, attn_mask=pmask, scale=scale,
                                                                    enable_gqa=True),
            pk.shape[1] * pk.shape[2], 2 * pk.numel() * pk.element_size(), float("nan"))
    if dev == "cuda":  # the kernel reading format v5's compact int4 layout as stored (no dequantized rows)
        ca = compact_case(case["ours-keep"], args.group_size)
        fn = lambda: kernels.compact_decode_triton(tail_keys=case["ours-keep"]["tail_keys"],  # noqa: E731
                                                   tail_values=case["ours-keep"]["tail_values"], **ca)
        err = (fn().float() - out).abs().max().item()  # against the packed-cache output over the bf16 rows
        nbytes = sum(t.numel() * t.element_size() for t in ca.values() if torch.is_tensor(t))
        measure("ours-keep-compact-int4", fn, ca["key_codes"].shape[0] + hkv, nbytes, err)
    for name, a in case.items():
        if args.no_reference and dev == "cpu":
            continue
        fn = lambda a=a: kernels.varlen_decode(**a, backend=backend, validate=False)  # noqa: E731
        out = fn().float()
        err = (out - kernels.varlen_decode_reference(**a).float()).abs().max().item()
        if name == "ours-full":  # same KV as SDPA: the kernel must agree with it too
            err = max(err, (out - expected_full).abs().max().item())
        n_rows = a["fp_keys"].shape[0] + a["tail_keys"].shape[0] * a["tail_keys"].shape[1] + \
            (a["key_codes"].shape[0] if "key_codes" in a else 0)
        measure(name, fn, n_rows, kv_bytes(a), err)

    timed_all()

    def best(r):  # the GPU time (graph replay) where there is one
        return r["graph_us"] if r["graph_us"] is not None else r["eager_us"]

    base = min(best(r) for r in rows if r["variant"].startswith("sdpa"))
    how = ("CUDA events, L2 flushed before each call; 'graph' replays a CUDA graph of the call (GPU time), "
           "'eager' calls it from Python (adds launch overhead)" if dev == "cuda" else
           "wall clock, interleaved rounds; ours-* rows are the reference path")
    lines = [f"`{cmd}`", "", ", ".join(f"{k} {v}" for k, v in info.items()), "",
             f"{H} query heads, {hkv} KV heads, head dim {D}, {N} tokens, keep {args.keep}, int4 G={args.group_size}; "
             f"{how}; medians of {args.reps}", "",
             "| variant | KV rows | KV MiB | graph us | eager us | min us | GB/s | speed-up vs SDPA | max abs err |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        r.update(gbps=r["bytes"] / best(r) / 1e3, speedup=base / best(r))
        g = f"{r['graph_us']:.1f}" if r["graph_us"] is not None else "-"
        lines.append(f"| {r['variant']} | {r['rows']} | {r['bytes'] / 2**20:.1f} | {g} | {r['eager_us']:.1f} | "
                     f"{r['min_us']:.1f} | {r['gbps']:.0f} | {r['speedup']:.2f}x | {r['err']:.2e} |")
    if dev == "cuda":
        lines += ["", "GB/s counts the KV bytes read once (keys, values, int4 codes, scales and mins); "
                  "speed-up is against the fastest SDPA row, graph times where there are some."]

    sweep = []
    if args.sweep and dev == "cuda":
        lines += ["", "Sweep, graph replay where capture works (launcher defaults: block_n 64, num_warps 4, or 8 "
                  "with int4, num_stages 3, num_splits auto)", "",
                  "| variant | block_n | num_warps | num_stages | num_splits | median us |",
                  "|---|---:|---:|---:|---:|---:|"]
        configs = [(bn, nw, ns, None) for bn in (32, 64, 128) for nw in (4, 8) for ns in (2, 3)]
        configs += [(64, None, 3, sp) for sp in (8, 16, 32, 64, 128)]
        for name in ("ours-keep", "ours-keep-int4"):
            a = case[name]
            for bn, nw, ns, sp in configs:
                try:
                    def fn():
                        return kernels.varlen_decode_triton(**a, block_n=bn, num_warps=nw, num_stages=ns,
                                                            num_splits=sp, validate=False)
                    fn()
                    replay = as_graph(fn)
                    med = statistics.median(run(replay or fn))
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for one config
                    med = float("nan")
                    print(f"# sweep {name} block_n={bn} num_warps={nw} num_stages={ns} num_splits={sp}: "
                          f"{type(e).__name__}: {str(e)[:200]}")
                sweep.append(dict(variant=name, block_n=bn, num_warps=nw or "default", num_stages=ns,
                                  num_splits=sp or "auto", median_us=med))
                lines.append(f"| {name} | {bn} | {nw or 'default'} | {ns} | {sp or 'auto'} | {med:.1f} |")
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_decode.md").write_text(table + "\n")
        (out / "bench_decode.json").write_text(json.dumps(dict(command=cmd, versions=info, args=vars(args),
                                                               budgets=b, rows=rows, sweep=sweep), indent=1))
        print(f"# wrote {out / 'bench_decode.md'} and bench_decode.json")


if __name__ == "__main__":
    main()
