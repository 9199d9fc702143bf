"""kernels.varlen_decode (Triton) against the plain PyTorch reference, and the reference against SDPA.

On CPU the Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set here before triton is
imported unless already set); with a GPU and TRITON_INTERPRET unset it runs on CUDA (tools/gpu_check.sh).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton / kernels.varlen_decode

ROOT = Path(__file__).resolve().parents[1]

from kvpack import kernels  # noqa: E402 - the kernels/ folder, installed as kvpack.kernels (its one name)
from kvpack.kernels import reference as ref  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


def _kernel_unavailable_reason():
    if not kernels.HAS_TRITON:
        return "triton is not importable"
    if DEVICE == "cpu" and not INTERPRET:
        return "no GPU and TRITON_INTERPRET is not 1: the Triton kernel cannot run here"
    if INTERPRET:  # older interpreters (e.g. triton 3.6 with numpy >= 2.4) cannot loop to a loaded bound
        import triton
        import triton.language as tl

        @triton.jit
        def probe(x):
            for i in range(0, tl.load(x)):
                tl.store(x + 1, i)

        try:
            probe[(1,)](torch.tensor([2, 0], dtype=torch.int32))
        except Exception as e:  # noqa: BLE001
            return f"triton {triton.__version__}'s interpreter cannot run loops with loaded bounds here: {e!r:.120}"
    return None


UNAVAILABLE = _kernel_unavailable_reason()
requires_kernel = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

# (atol, rtol) of kernel vs fp32 reference. The kernel feeds fp16/bf16 operands to its dot products
# (q*scale, the probabilities, dequantized values) and rounds the output to the input dtype.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close_report(out, expected, atol, rtol, what=""):
    """Like torch.testing.assert_close, but prints the first mismatching (head, channel) indices."""
    assert out.shape == expected.shape and out.dtype == expected.dtype, (out.shape, out.dtype, expected.shape)
    o, e = out.double().cpu(), expected.double().cpu()
    bad = ~((o - e).abs() <= atol + rtol * e.abs())  # also catches NaN
    if bad.any():
        idx = bad.nonzero()[:10].tolist()
        rows = "\n".join(f"  [head {i}, ch {j}] kernel {o[i, j].item():+.6f} ref {e[i, j].item():+.6f}"
                         for i, j in idx)
        pytest.fail(f"{what}: {int(bad.sum())}/{bad.numel()} mismatches (atol {atol}, rtol {rtol}), "
                    f"max abs err {(o - e).abs().nan_to_num(float('inf')).max().item():.3g}; first:\n{rows}")


def offsets(lengths, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=dtype)


def make_inputs(hkv, g, d, fp_lens, q_lens, t, dtype, group_size=32, quant=True, seed=0, q_gain=2.0):
    """Random layer inputs on DEVICE; the int4 rows come from quantizing random keys/values."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    nfp = sum(fp_lens)
    args = dict(q=(rnd(hkv * g, d) * q_gain).to(dtype),
                fp_keys=rnd(nfp, d).to(dtype), fp_values=rnd(nfp, d).to(dtype), fp_offsets=offsets(fp_lens),
                tail_keys=rnd(hkv, t, d).to(dtype), tail_values=rnd(hkv, t, d).to(dtype), scale=d ** -0.5)
    if quant:
        nq = sum(q_lens)
        kc, ks, km = ref.quantize_int4_keys(rnd(nq, d) + rnd(1, d) * 3, group_size)  # channel outliers
        vc, vs, vm = ref.quantize_int4_values(rnd(nq, d), group_size)
        args.update(key_codes=kc, key_scales=ks, key_mins=km, value_codes=vc, value_scales=vs, value_mins=vm,
                    q_offsets=offsets(q_lens, torch.int64), group_size=group_size)
    return {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in args.items()}


# (hkv, GQA group g, D, G, T, fp rows per head, int4 rows per head, num_splits); lengths 0, 1, 31, 33, 1000
CASES = {
    "mixed-g1-d64": (5, 1, 64, 32, 0, [0, 1, 31, 33, 1000], [32, 0, 64, 0, 1024], 1),
    "g4-d128-split4": (3, 4, 128, 64, 1, [1000, 33, 0], [0, 64, 960], 4),
    "g7-d128-t5-split3": (2, 7, 128, 32, 5, [31, 1], [1024, 32], 3),
    "g4-d64-G64-t5-auto": (4, 4, 64, 64, 5, [1, 0, 1000, 31], [64, 0, 0, 128], None),
}


@requires_kernel
@pytest.mark.parametrize("quant", [False, True], ids=["fp", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_matches_reference(case, dtype, quant):
    hkv, g, d, gs, t, fp_lens, q_lens, splits = CASES[case]
    args = make_inputs(hkv, g, d, fp_lens, q_lens, t, dtype, gs, quant)
    out = kernels.varlen_decode_triton(**args, num_splits=splits)
    expected = kernels.varlen_decode_reference(**args)
    assert_close_report(out, expected, *TOLERANCES[dtype], what=f"{case} {dtype} quant={quant}")


GRID = [(g, d, gs, t) for g in (1, 4, 7) for d in (64, 128) for gs in (32, 64) for t in (0, 1, 5)]
LENGTHS = [0, 1, 31, 33, 1000]


@requires_kernel
@pytest.mark.parametrize("quant", [False, True], ids=["fp", "int4"])
@pytest.mark.parametrize("i", range(len(GRID)), ids=[f"g{g}-d{d}-G{gs}-t{t}" for g, d, gs, t in GRID])
def test_kernel_grid(i, quant):
    """Every (GQA group, D, G, T) combination; dtype, per-head lengths and splits rotate with the index."""
    g, d, gs, t = GRID[i]
    dtype = DTYPES[i % 3]
    fp_lens = [LENGTHS[(i + h) % 5] for h in range(3)]
    q_lens = [gs * ((i + 2 * h) % 3) for h in range(3)]
    args = make_inputs(3, g, d, fp_lens, q_lens, t, dtype, gs, quant, seed=i)
    out = kernels.varlen_decode_triton(**args, num_splits=(1, 2, 5)[i % 3])
    assert_close_report(out, kernels.varlen_decode_reference(**args), *TOLERANCES[dtype],
                        what=f"g={g} D={d} G={gs} T={t} {dtype} fp={fp_lens} int4={q_lens if quant else None}")


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_head_dim_not_power_of_two(dtype):
    """D = Dv = 96 (e.g. Phi-3): masked channels; Gv = 32 gives 3 value groups."""
    args = make_inputs(2, 2, 96, [33, 1], [32, 64], 1, dtype, group_size=32)
    out = kernels.varlen_decode_triton(**args, num_splits=2)
    assert_close_report(out, kernels.varlen_decode_reference(**args), *TOLERANCES[dtype], what="D=96")


@requires_kernel
@pytest.mark.parametrize("splits", [1, 4], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("quant", [False, True], ids=["fp", "int4"])
def test_empty_heads_give_zeros(quant, splits):
    """A head whose three segments are all empty outputs zeros, never NaN; its neighbours are unaffected.
    num_splits=4 also leaves splits with no block at all."""
    args = make_inputs(3, 2, 64, [0, 33, 0], [0, 0, 32], 0, torch.float16, quant=quant)
    out = kernels.varlen_decode_triton(**args, num_splits=splits)
    assert not out.isnan().any()
    assert (out[0:2] == 0).all() and (out[2:4] != 0).any()
    assert_close_report(out, kernels.varlen_decode_reference(**args), *TOLERANCES[torch.float16], what="empty")
    args = make_inputs(2, 3, 64, [0, 0], [0, 0], 0, torch.float32, quant=quant)  # every head empty
    out = kernels.varlen_decode_triton(**args, num_splits=splits)
    assert (out == 0).all()


@requires_kernel
def test_kernel_rejects_bad_layout():
    args = make_inputs(2, 1, 64, [1, 1], [32, 32], 0, torch.float32)
    args["q_offsets"] = torch.tensor([0, 16, 64], device=DEVICE)  # not a multiple of G = 32
    with pytest.raises(ValueError, match="multiples of the group size"):
        kernels.varlen_decode_triton(**args)
    args = make_inputs(2, 1, 64, [1, 1], [0, 0], 0, torch.float32, quant=False)
    args["fp_offsets"] = torch.tensor([0, 2, 1], device=DEVICE)
    with pytest.raises(ValueError, match="non-decreasing"):
        kernels.varlen_decode_triton(**args)


# ---- the reference itself ----

def test_int4_nibble_order_and_dequantize():
    """Low nibble = even channel; keys: per-channel scale of the row's group; values: per-token over Gv."""
    codes = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)
    assert ref.unpack_int4(codes).tolist() == [[1, 2, 0, 15]]
    assert torch.equal(ref.pack_int4(ref.unpack_int4(codes)), codes)
    kc = codes.repeat(32, 1)  # 32 rows = one group of G = 32
    ks = torch.tensor([[1.0, 2.0, 0.5, 0.25]]).half()
    km = torch.tensor([[0.0, -1.0, 1.0, 0.0]]).half()
    assert ref.dequantize_int4_keys(kc, ks, km, 32)[5].tolist() == [1.0, 3.0, 1.0, 3.75]
    vs = torch.full((32, 1), 0.5).half()  # Gv = min(32, Dv = 4) = 4: one group per row
    vm = torch.full((32, 1), -1.0).half()
    assert ref.dequantize_int4_values(kc, vs, vm, 32)[0].tolist() == [-0.5, 0.0, -1.0, 6.5]


@pytest.mark.parametrize("group_size", [32, 64])
def test_quantize_roundtrip_error_within_half_step(group_size):
    x = torch.randn(128, 64)
    kc, ks, km = ref.quantize_int4_keys(x, group_size)
    k_err = (ref.dequantize_int4_keys(kc, ks, km, group_size) - x).abs()
    assert (k_err <= ks.float().repeat_interleave(group_size, 0) * 0.5 + 2e-2).all()
    vc, vs, vm = ref.quantize_int4_values(x, group_size)
    v_err = (ref.dequantize_int4_values(vc, vs, vm, group_size) - x).abs()
    assert (v_err <= vs.float().repeat_interleave(min(group_size, 64), 1) * 0.5 + 2e-2).all()


def test_reference_matches_masked_sdpa():
    """Independent check of the reference: padded dense K/V, a padding mask and torch SDPA with GQA."""
    hkv, g, d, lens, t = 3, 2, 16, [0, 5, 9], 2
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(hkv * g, d, generator=gen)
    fk, fv = torch.randn(sum(lens), d, generator=gen), torch.randn(sum(lens), d, generator=gen)
    tk, tv = torch.randn(hkv, t, d, generator=gen), torch.randn(hkv, t, d, generator=gen)
    out = kernels.varlen_decode_reference(q, fk, fv, offsets(lens), tk, tv, 0.3)
    n = max(lens) + t
    k, v, mask = torch.zeros(hkv, n, d), torch.zeros(hkv, n, d), torch.zeros(hkv, n, dtype=torch.bool)
    o = offsets(lens).tolist()
    for h in range(hkv):
        rows = torch.cat([fk[o[h]:o[h + 1]], tk[h]]), torch.cat([fv[o[h]:o[h + 1]], tv[h]])
        k[h, :len(rows[0])], v[h, :len(rows[0])], mask[h, :len(rows[0])] = rows[0], rows[1], True
    kk, vv, mm = (x.repeat_interleave(g, 0) for x in (k, v, mask))
    dense = torch.nn.functional.scaled_dot_product_attention(
        q[:, None], kk, vv, attn_mask=mm[:, None], scale=0.3)[:, 0]
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_dispatch_reference_path_and_import_without_triton():
    args = make_inputs(2, 2, 64, [3, 0], [32, 0], 1, torch.float32)
    args = {k: v.cpu() if torch.is_tensor(v) else v for k, v in args.items()}
    out = kernels.varlen_decode(**args, backend="reference", num_splits=2)
    assert torch.equal(out, kernels.varlen_decode_reference(**args))
    code = ("import sys; sys.modules['triton'] = None; from kvpack import kernels; assert not kernels.HAS_TRITON; "
            "print('ok')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def _with_biases(args, seed=3):
    """``args`` plus random per-row logit biases (Attention Matching's beta) for the fp and int4 rows."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(args, fp_biases=(torch.rand(args["fp_keys"].shape[0], generator=gen) * 6 - 3).to(DEVICE))
    if "key_codes" in args:
        out["q_biases"] = (torch.rand(args["key_codes"].shape[0], generator=gen) * 6 - 3).to(DEVICE)
    return out


@requires_kernel
@pytest.mark.parametrize("quant", [False, True], ids=["fp", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["mixed-g1-d64", "g7-d128-t5-split3"])
def test_kernel_honours_biases(case, dtype, quant):
    """With per-row biases the kernel matches the reference, and the biases change the output (not ignored)."""
    hkv, g, d, gs, t, fp_lens, q_lens, splits = CASES[case]
    args = _with_biases(make_inputs(hkv, g, d, fp_lens, q_lens, t, dtype, gs, quant))
    out = kernels.varlen_decode_triton(**args, num_splits=splits)
    expected = kernels.varlen_decode_reference(**args)
    assert_close_report(out, expected, *TOLERANCES[dtype], what=f"{case} {dtype} quant={quant} biases")
    plain = {k: v for k, v in args.items() if k not in ("fp_biases", "q_biases")}
    assert (kernels.varlen_decode_reference(**plain).float() - expected.float()).abs().max() > 0.05


def test_reference_biases_match_explicit_softmax():
    """The reference with biases is ``softmax(q . k * scale + b) v`` over [fp rows | tail], tail bias 0."""
    hkv, g, d, lens, t = 2, 3, 8, [4, 6], 2
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(hkv * g, d, generator=gen)
    fk, fv = torch.randn(sum(lens), d, generator=gen), torch.randn(sum(lens), d, generator=gen)
    tk, tv = torch.randn(hkv, t, d, generator=gen), torch.randn(hkv, t, d, generator=gen)
    fb = torch.randn(sum(lens), generator=gen) * 2
    out = kernels.varlen_decode_reference(q, fk, fv, offsets(lens), tk, tv, 0.4, fp_biases=fb)
    o = offsets(lens).tolist()
    for j in range(hkv * g):
        h = j // g
        k, v = torch.cat([fk[o[h]:o[h + 1]], tk[h]]), torch.cat([fv[o[h]:o[h + 1]], tv[h]])
        b = torch.cat([fb[o[h]:o[h + 1]], torch.zeros(t)])
        logits = [float(q[j] @ k[n]) * 0.4 + float(b[n]) for n in range(len(k))]
        weights = torch.tensor([math.exp(x - max(logits)) for x in logits])
        torch.testing.assert_close(out[j], (weights / weights.sum()) @ v, atol=1e-5, rtol=1e-5)


@requires_kernel
def test_kernel_rejects_bad_biases():
    args = make_inputs(2, 2, 64, [3, 5], [], 1, torch.float32, quant=False)
    for bad in (torch.zeros(7), torch.zeros(8, dtype=torch.float16)):
        with pytest.raises(ValueError, match="fp_biases"):
            kernels.varlen_decode_triton(**args, fp_biases=bad.to(DEVICE))


@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("biased", [True, False])
def test_cache_decode_through_the_kernel_matches_the_cpu_path(dtype, biased):
    """The call kvpack's packed cache makes on CUDA (``kvpack.varlen.triton_decode``) against its CPU path."""
    from kvpack.cache import PackedLayer
    from kvpack.varlen import _packed_attention_torch, triton_decode

    gen = torch.Generator().manual_seed(4)
    lengths, d, hkv, g = [40, 0, 3, 77], 64, 4, 3
    n = sum(lengths)
    layer = PackedLayer(torch.randn(n, d, generator=gen).to(dtype).to(DEVICE),
                        torch.randn(n, d, generator=gen).to(dtype).to(DEVICE),
                        torch.cat([torch.arange(m) for m in lengths]).to(DEVICE), lengths, 100,
                        biases=(torch.randn(n, generator=gen) * 2).to(DEVICE) if biased else None)
    layer.update(torch.randn(1, hkv, 3, d, generator=gen).to(dtype).to(DEVICE),
                 torch.randn(1, hkv, 3, d, generator=gen).to(dtype).to(DEVICE))
    query = torch.randn(1, hkv * g, 1, d, generator=gen).to(dtype).to(DEVICE)
    out = triton_decode(query, layer, d ** -0.5, validate=True)
    expected = _packed_attention_torch(query, layer, d ** -0.5, None)
    assert out.shape == expected.shape == (1, 1, hkv * g, d)
    assert_close_report(out[0, 0], expected[0, 0], *TOLERANCES[dtype], what=f"cache decode {dtype}")


# --- the compact quantized layout (format v4/v5), dequantized on the fly ----------------------------------------


def _compact_layer(qtype, d, group, energy_seed, biased):
    """A compact-quantized layer of 5 KV heads (sink rows, bodies with short last groups, a head below G, an empty
    head), per-channel key widths from random query energies, and optional per-entry biases."""
    from kvpack.pack import LayerEntries, Pack
    from kvpack.quant import quantize_pack

    gen = torch.Generator().manual_seed(energy_seed)
    heads = [[0, 1, 2, *range(10, 80)], [0, 1, 2, *range(5, 20)], list(range(40, 72)), [], [1, *range(4, 45)]]
    n = sum(map(len, heads))
    layer = LayerEntries(torch.randn(n, d, generator=gen) + torch.randn(1, d, generator=gen) * 3,
                         torch.randn(n, d, generator=gen),
                         torch.tensor([p for h in heads for p in h], dtype=torch.int32),
                         torch.tensor([len(h) for h in heads]),
                         biases=(torch.randn(n, generator=gen) * 2) if biased else None)
    energy = [torch.rand(len(heads), d, generator=gen) ** 4]  # skewed: the widths differ across channels
    q = quantize_pack(Pack(torch.arange(80), [layer], 3, {}), qtype, group, query_energy=energy)
    return q.layers[0]


@requires_kernel
@pytest.mark.parametrize("qtype,group", [("int4", 16), ("int4", 32), ("int8", 16)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("biased", [True, False])
@pytest.mark.parametrize("splits", [1, 3])
def test_compact_kernel_matches_the_cache_over_dequantized_rows(qtype, group, dtype, biased, splits):
    """The kernel reading the stored compact codes equals the cache's CPU path over the rows the loader
    dequantizes (``KvpackCache.from_pack``) from the same layer, biases included."""
    from kvpack.cache import KvpackCache
    from kvpack.pack import Pack
    from kvpack.compact_cache import compact_kernel_args
    from kvpack.varlen import _packed_attention_torch

    d, hkv, g = 32, 5, 3
    entries = _compact_layer(qtype, d, group, 7, biased)
    assert entries.quant.layout == "compact"
    assert qtype == "int8" or entries.quant.key_bits.unique().numel() > 1  # int8: every width is 8
    layer = KvpackCache.from_pack(Pack(torch.arange(80), [entries], 3, {}), dtype=dtype, device=DEVICE).layers[0]
    gen = torch.Generator().manual_seed(8)
    layer.update(torch.randn(1, hkv, 2, d, generator=gen).to(dtype).to(DEVICE),
                 torch.randn(1, hkv, 2, d, generator=gen).to(dtype).to(DEVICE))
    query = (torch.randn(1, hkv * g, 1, d, generator=gen) * 2).to(dtype).to(DEVICE)
    args = compact_kernel_args(entries, dtype, DEVICE)
    out = kernels.compact_decode_triton(query[0, :, 0], tail_keys=layer.keys[0], tail_values=layer.values[0],
                                        scale=d ** -0.5, num_splits=splits, **args)
    expected = _packed_attention_torch(query, layer, d ** -0.5, None)[0, 0]
    assert_close_report(out, expected, *TOLERANCES[dtype], what=f"compact {qtype} G={group} {dtype}")


def test_compact_scale_multipliers_are_the_formats():
    from kvpack.kernels.compact_decode import scale_multipliers
    from kvpack.compact import scale_table

    assert torch.equal(scale_multipliers("cpu"), scale_table(torch.ones(1))[0])


@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("biased", [True, False])
@pytest.mark.parametrize("q_len", [1, 3])
def test_on_the_fly_cache_layer_decodes_through_the_compact_kernel(dtype, biased, q_len, monkeypatch):
    """A ``CompactLayer`` (``dequantize="on-the-fly"``) where the kernel runs: ``packed_attention`` reads the codes
    through ``kernels.compact_decode_triton`` (one call per query token, causal over the tail) and equals the
    at-load layer's CPU path over the dequantized rows, for one decode token and a 3-token question alike."""
    from kvpack.cache import KvpackCache
    from kvpack.compact_cache import CompactLayer
    from kvpack.pack import Pack
    from kvpack.varlen import _packed_attention_torch, packed_attention

    d, hkv, g = 32, 5, 3
    entries = _compact_layer("int4", d, 16, 11, biased)
    pack = Pack(torch.arange(80), [entries], 3, {})
    at_load = KvpackCache.from_pack(pack, dtype=dtype, device=DEVICE).layers[0]
    fly = KvpackCache.from_pack(pack, dtype=dtype, device=DEVICE, dequantize="on-the-fly").layers[0]
    assert isinstance(fly, CompactLayer)
    calls = []
    real = kernels.compact_decode_triton
    monkeypatch.setattr(kernels, "compact_decode_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(12)
    for layer_ in (at_load, fly):
        gen.manual_seed(12)
        layer_.update(torch.randn(1, hkv, 4, d, generator=gen).to(dtype).to(DEVICE),
                      torch.randn(1, hkv, 4, d, generator=gen).to(dtype).to(DEVICE))
    query = (torch.randn(1, hkv * g, q_len, d, generator=gen) * 2).to(dtype).to(DEVICE)
    out = packed_attention(query, fly, d ** -0.5)
    assert len(calls) == q_len
    expected = _packed_attention_torch(query, at_load, d ** -0.5, None)
    assert out.shape == expected.shape == (1, q_len, hkv * g, d)
    assert_close_report(out.reshape(-1, d), expected.reshape(-1, d), *TOLERANCES[dtype], what=f"on the fly {dtype}")


@requires_kernel
def test_on_the_fly_layer_without_full_precision_rows():
    """Every row quantized (no sink, every head at least G rows): the kernel's full-precision segment is empty."""
    from kvpack.cache import KvpackCache
    from kvpack.pack import LayerEntries, Pack
    from kvpack.quant import quantize_pack
    from kvpack.varlen import _packed_attention_torch, packed_attention

    gen = torch.Generator().manual_seed(0)
    d, heads = 32, [list(range(10, 42)), list(range(5, 37))]
    n = sum(map(len, heads))
    raw = LayerEntries(torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen),
                       torch.tensor([p for h in heads for p in h], dtype=torch.int32), torch.tensor([32, 32]))
    pack = quantize_pack(Pack(torch.arange(50), [raw], 3, {}), "int4", 16)
    assert pack.layers[0].keys.shape[0] == 0 and pack.layers[0].quant.body_lengths.tolist() == [32, 32]
    at_load = KvpackCache.from_pack(pack, device=DEVICE).layers[0]
    fly = KvpackCache.from_pack(pack, device=DEVICE, dequantize="on-the-fly").layers[0]
    for layer in (at_load, fly):
        gen.manual_seed(1)
        layer.update(torch.randn(1, 2, 2, d, generator=gen).to(DEVICE),
                     torch.randn(1, 2, 2, d, generator=gen).to(DEVICE))
    query = torch.randn(1, 4, 1, d, generator=gen).to(DEVICE)
    assert_close_report(packed_attention(query, fly, d ** -0.5)[0, 0],
                        _packed_attention_torch(query, at_load, d ** -0.5, None)[0, 0], *TOLERANCES[torch.float32],
                        what="body-only layer")
