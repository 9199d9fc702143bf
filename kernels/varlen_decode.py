"""Triton kernel + launcher: one decode step of attention over per-head variable-length KV, int4 optional.

Math. For query head j (KV head h = j // g) and the visible rows k_1..k_N, v_1..v_N of head h
(full-precision rows, then int4 rows dequantized on the fly, then the dense tail):

    out_j = sum_n softmax_n(scale * q_j . k_n + b_n) v_n,       k_hat = code * scale + min   (int4 rows)

(b_n: the row's optional additive logit bias, Attention Matching's beta, arXiv 2602.16284 §3; 0 for the tail)

computed as a streaming ("online") softmax over blocks of BLOCK_N rows with fp32 state (m, l, acc):

    m' = max(m, max_n s_n);  l' = l * 2^(m - m') + sum_n 2^(s_n - m');  acc' = acc * 2^(m - m') + P V

(FlashAttention, arXiv 2205.14135, section 3.1), in base 2 with log2(e) folded into `scale`. As in
flash-decoding, each KV head's blocks are split over NUM_SPLITS programs whose partial (m, l, acc) are
merged by a second small kernel. A head with no visible row has l = 0 and outputs zeros (never NaN).

int4 rows use the KIVI layout (arXiv 2402.02750): keys quantized per channel over groups of G rows,
values per token over groups of Gv = min(G, Dv) channels; two codes per byte, the low nibble is the even
channel. Keys are never dequantized: within one G-row group the scale s and min m of a channel are
constant, so q . k_hat = sum_c (q_c s_c) code_c + sum_c q_c m_c, one dot product of (q * s) with the raw
codes plus one per-group bias. The two nibbles of a byte are unpacked with tl.interleave; a value row's
per-group scale/min are broadcast to its channels with a reshape (Gv is a power of two, or Gv = Dv).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .reference import value_group_size

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # as triton.jit read it at import

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton#11584); same values in fp32
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=DOT_PREC)
    return r


@triton.jit
def _online_update(m_i, l_i, acc, qk, v, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    # qk (BLOCK_G, BN) fp32 base-2 logits, -inf where masked; v (BN, BLOCK_DV) in the dot dtype
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no finite logit yet: avoid -inf - -inf
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _varlen_decode_kernel(
    Q, stride_q,                                   # (H, D)
    FK, stride_fk, FV, stride_fv, FP_OFF,          # (Nfp, D), (Nfp, Dv), (Hkv+1,)
    KC, KS, KM, VC, VS, VM, Q_OFF,                 # (Q, D/2), (Q/G, D) x2, (Q, Dv/2), (Q, Dv/Gv) x2, (Hkv+1,)
    TK, stride_tkh, stride_tkt, TV, stride_tvh, stride_tvt, T,   # (Hkv, T, D), (Hkv, T, Dv)
    FB, QB,                                        # (Nfp,), (Q,) fp32 logit biases when BIAS
    O, stride_o,                                   # (H, Dv) output, written when not SPLIT
    PM, PL, PACC,                                  # (H, S), (H, S), (H, S, Dv) fp32 partials when SPLIT
    qk_scale, group, num_splits,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_NQ: tl.constexpr, GROUP_Q: tl.constexpr, GROUP_V: tl.constexpr,
    NGV_P2: tl.constexpr,
    QUANT: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    BIAS: tl.constexpr,
):
    h = tl.program_id(0)       # KV head
    s = tl.program_id(1)       # split: takes this head's blocks s, s + S, s + 2S, ... of [fp | int4 | tail]
    dt = Q.dtype.element_ty

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < group
    qrows = (h * group + offs_g).to(tl.int64)      # the g query heads sharing KV head h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q = tl.load(Q + qrows[:, None] * stride_q + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)            # (BLOCK_G, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    v_mask = offs_v < DV

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)

    # ---- segment 1: full-precision rows ----
    fp_lo = tl.load(FP_OFF + h).to(tl.int64)
    n_fp = (tl.load(FP_OFF + h + 1) - tl.load(FP_OFF + h)).to(tl.int32)
    nb_fp = tl.cdiv(n_fp, BLOCK_N)
    for b in range(s, nb_fp, num_splits):
        offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_fp
        rows = fp_lo + offs_n
        k = tl.load(FK + rows[:, None] * stride_fk + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)         # (BN, BLOCK_D)
        qk = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * qk_scale
        if BIAS:  # base 2: the bias is scaled by log2(e) like the logits
            qk += (tl.load(FB + rows, mask=n_mask, other=0.0) * LOG2E_C)[None, :]
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        v = tl.load(FV + rows[:, None] * stride_fv + offs_v[None, :],
                    mask=n_mask[:, None] & v_mask[None, :], other=0.0)         # (BN, BLOCK_DV)
        m_i, l_i, acc = _online_update(m_i, l_i, acc, qk, v, DOT_PREC, UPCAST)

    # ---- segment 2: int4 rows (KIVI), dequantized on the fly ----
    nb_q = 0
    if QUANT:
        qf = q.to(tl.float32)
        offs_c = tl.arange(0, BLOCK_D // 2)                                  # key bytes (channel pairs)
        c_mask = offs_c < D // 2
        offs_cv = tl.arange(0, BLOCK_DV // 2)                                # value bytes
        cv_mask = offs_cv < DV // 2
        offs_sg = tl.arange(0, NGV_P2)                                       # value scale groups
        sg_mask = offs_sg < DV // GROUP_V
        q_lo = tl.load(Q_OFF + h).to(tl.int64)
        n_q = (tl.load(Q_OFF + h + 1) - tl.load(Q_OFF + h)).to(tl.int32)
        nb_q = tl.cdiv(n_q, BLOCK_NQ)
        start_q = (s - nb_fp % num_splits + num_splits) % num_splits
        for b in range(start_q, nb_q, num_splits):
            rows = q_lo + b * BLOCK_NQ + tl.arange(0, BLOCK_NQ)   # n_q % G == 0 and G % BLOCK_NQ == 0: all valid
            grp = (q_lo + b * BLOCK_NQ) // GROUP_Q                 # one key scale row for the whole block
            ks = tl.load(KS + grp * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            km = tl.load(KM + grp * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            kc = tl.load(KC + rows[:, None] * (D // 2) + offs_c[None, :], mask=c_mask[None, :], other=0)
            codes = tl.interleave(kc & 15, kc >> 4).to(tl.float32).to(dt)      # (BN, BLOCK_D), exact
            # q . (code * s + m) = (q * s) . code + q . m
            qk = _dot((qf * ks[None, :]).to(dt), tl.trans(codes), DOT_PREC, UPCAST)
            qk = (qk + tl.sum(qf * km[None, :], 1)[:, None]) * qk_scale
            if BIAS:
                qk += (tl.load(QB + rows) * LOG2E_C)[None, :]
            vc = tl.load(VC + rows[:, None] * (DV // 2) + offs_cv[None, :], mask=cv_mask[None, :], other=0)
            sp = rows[:, None] * (DV // GROUP_V) + offs_sg[None, :]
            vs = tl.load(VS + sp, mask=sg_mask[None, :], other=0.0).to(tl.float32)   # (BN, NGV_P2)
            vm = tl.load(VM + sp, mask=sg_mask[None, :], other=0.0).to(tl.float32)
            if NGV_P2 == 1:  # one scale per row (Gv = Dv)
                vs_b = vs
                vm_b = vm
            else:            # Gv a power of two: scale of channel c is column c // Gv
                vs_b = tl.reshape(tl.broadcast_to(vs[:, :, None], (BLOCK_NQ, NGV_P2, GROUP_V)), (BLOCK_NQ, BLOCK_DV))
                vm_b = tl.reshape(tl.broadcast_to(vm[:, :, None], (BLOCK_NQ, NGV_P2, GROUP_V)), (BLOCK_NQ, BLOCK_DV))
            v = (tl.interleave(vc & 15, vc >> 4).to(tl.float32) * vs_b + vm_b).to(dt)   # (BN, BLOCK_DV)
            m_i, l_i, acc = _online_update(m_i, l_i, acc, qk, v, DOT_PREC, UPCAST)

    # ---- segment 3: dense tail shared layout (Hkv, T, D) ----
    nb_t = tl.cdiv(T, BLOCK_N)
    start_t = (s - (nb_fp + nb_q) % num_splits + num_splits) % num_splits
    for b in range(start_t, nb_t, num_splits):
        offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < T
        k = tl.load(TK + h * stride_tkh + offs_n[:, None] * stride_tkt + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        qk = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        v = tl.load(TV + h * stride_tvh + offs_n[:, None] * stride_tvt + offs_v[None, :],
                    mask=n_mask[:, None] & v_mask[None, :], other=0.0)
        m_i, l_i, acc = _online_update(m_i, l_i, acc, qk, v, DOT_PREC, UPCAST)

    if SPLIT:
        pr = qrows * num_splits + s
        tl.store(PM + pr, m_i, mask=g_mask)
        tl.store(PL + pr, l_i, mask=g_mask)
        tl.store(PACC + pr[:, None] * DV + offs_v[None, :], acc, mask=g_mask[:, None] & v_mask[None, :])
    else:
        inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)   # empty head: acc = 0, l = 0 -> zeros
        tl.store(O + qrows[:, None] * stride_o + offs_v[None, :], (acc * inv[:, None]).to(dt),
                 mask=g_mask[:, None] & v_mask[None, :])


@triton.jit
def _combine_kernel(PM, PL, PACC, O, stride_o, num_splits,
                    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s; zeros if every l_s = 0."""
    row = tl.program_id(0).to(tl.int64)   # query head
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    m = tl.load(PM + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    l = tl.load(PL + row * num_splits + offs_s, mask=s_mask, other=0.0)
    mx = tl.max(m, 0)
    w = tl.exp2(m - tl.where(mx == float("-inf"), 0.0, mx))
    denom = tl.sum(w * l, 0)
    offs_v = tl.arange(0, BLOCK_DV)
    acc = tl.load(PACC + (row * num_splits + offs_s[:, None]) * DV + offs_v[None, :],
                  mask=s_mask[:, None] & (offs_v[None, :] < DV), other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(O + row * stride_o + offs_v, out.to(O.dtype.element_ty), mask=offs_v < DV)


_SM_COUNT: dict[int, int] = {}


def _default_splits(q, hkv, rows_per_head, block_n):
    if q.is_cuda:
        idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        target = 2 * _SM_COUNT[idx]   # about two waves of programs
    else:
        target = 1                    # interpreter: fewest programs is fastest
    blocks = max(1, triton.cdiv(int(rows_per_head), block_n))
    return max(1, min(blocks, triton.cdiv(target, hkv)))


def _check_offsets(name, off, hkv, n, multiple=1):
    o = off.tolist()
    if len(o) != hkv + 1 or o[0] < 0 or o[-1] > n or any(b < a for a, b in zip(o, o[1:])):
        raise ValueError(f"{name} must be {hkv + 1} non-decreasing offsets within [0, {n}], got {o}")
    if any(x % multiple for x in o):
        raise ValueError(f"{name} must be multiples of the group size {multiple}, got {o}")


def varlen_decode_triton(q, fp_keys, fp_values, fp_offsets, tail_keys, tail_values, scale,
                         key_codes=None, key_scales=None, key_mins=None,
                         value_codes=None, value_scales=None, value_mins=None,
                         q_offsets=None, group_size=None, fp_biases=None, q_biases=None, *,
                         num_splits=None, block_n=64, num_warps=None, num_stages=3, validate=True):
    """One decode step; arguments as in kernels.reference.varlen_decode_reference. -> [H, Dv] in q.dtype.

    fp_biases ([Nfp] float32) and q_biases ([Q] float32, int4 rows) are optional per-row logit biases; with
    either given, the other defaults to zeros.

    The int4 segment is present when key_codes is given (then every key_/value_ tensor, q_offsets and
    group_size are required). num_splits=None picks about two waves of programs on a GPU (1 on CPU);
    num_warps=None is 8 with int4 rows (fewer registers per thread) and 4 without. Defaults were chosen from
    sm_90 register/shared-memory reports, not timings; tools/bench_decode.py --sweep times the alternatives.
    validate=True also checks offset contents, which reads them back to the host (a sync); pass False
    in a decode loop (and under CUDA graph capture) once the layout is known good.
    """
    H, D = q.shape
    hkv = fp_offsets.numel() - 1
    dv = fp_values.shape[1]
    T = tail_keys.shape[1]
    quant = key_codes is not None
    dt = q.dtype
    if dt not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be float16, bfloat16 or float32, got {dt}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if hkv < 1 or H % hkv:
        raise ValueError(f"{H} query heads are not a multiple of {hkv} KV heads")
    nfp = fp_keys.shape[0]
    for name, t, shape in (("fp_keys", fp_keys, (nfp, D)), ("fp_values", fp_values, (nfp, dv)),
                           ("tail_keys", tail_keys, (hkv, T, D)), ("tail_values", tail_values, (hkv, T, dv))):
        if tuple(t.shape) != shape or t.dtype != dt:
            raise ValueError(f"{name}: expected shape {shape} and dtype {dt}, got {tuple(t.shape)} {t.dtype}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    q = q if q.stride(-1) == 1 else q.contiguous()
    g = H // hkv
    if quant:
        G = int(group_size)
        gv = value_group_size(G, dv)
        nq = key_codes.shape[0]
        if G < 16 or G & (G - 1) or D % 2 or dv % 2 or dv % gv:
            raise ValueError(f"int4 needs a power-of-two group size G >= 16, even D and Dv, and Dv a multiple of "
                             f"Gv = min(G, Dv); got G={G}, D={D}, Dv={dv}")
        for name, t, shape, tdt in (("key_codes", key_codes, (nq, D // 2), torch.uint8),
                                    ("key_scales", key_scales, (nq // G, D), None),
                                    ("key_mins", key_mins, (nq // G, D), None),
                                    ("value_codes", value_codes, (nq, dv // 2), torch.uint8),
                                    ("value_scales", value_scales, (nq, dv // gv), None),
                                    ("value_mins", value_mins, (nq, dv // gv), None)):
            if tuple(t.shape) != shape or (tdt is not None and t.dtype != tdt) or not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous {shape}{' ' + str(tdt) if tdt else ''}, "
                                 f"got {tuple(t.shape)} {t.dtype}")
        if nq % G:
            raise ValueError(f"{nq} int4 rows are not a multiple of the group size {G}")
    if validate:
        _check_offsets("fp_offsets", fp_offsets, hkv, fp_keys.shape[0])
        if quant:
            _check_offsets("q_offsets", q_offsets, hkv, nq, G)

    has_bias = fp_biases is not None or q_biases is not None
    if has_bias:
        fb = fp_biases if fp_biases is not None else torch.zeros(nfp, device=q.device)
        qb = q_biases if q_biases is not None else torch.zeros(nq if quant else 0, device=q.device)
        for name, t, n in (("fp_biases", fb, nfp), ("q_biases", qb, nq if quant else 0)):
            if tuple(t.shape) != (n,) or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous ({n},) float32, got {tuple(t.shape)} {t.dtype}")
        if not quant:
            qb = fb  # unused pointer
    else:
        fb = qb = fp_keys  # unused pointers
    rows_per_head = (fp_keys.shape[0] + (nq if quant else 0)) / hkv + T
    S = num_splits or _default_splits(q, hkv, rows_per_head, block_n)
    out = torch.empty(H, dv, dtype=dt, device=q.device)
    split = S > 1
    if split:
        pm = torch.empty(H, S, dtype=torch.float32, device=q.device)
        pl = torch.empty(H, S, dtype=torch.float32, device=q.device)
        pacc = torch.empty(H, S, dv, dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = out   # unused
    if quant:
        qargs = (key_codes, key_scales, key_mins, value_codes, value_scales, value_mins, q_offsets)
    else:
        G, gv = 32, dv
        qargs = (fp_keys,) * 6 + (fp_offsets,)   # unused pointers
    np2 = triton.next_power_of_2
    ngv = dv // gv
    ngv_p2 = np2(ngv)
    block_dv = np2(dv) if ngv == 1 else ngv_p2 * gv   # several value groups: Gv = G, a power of two
    _varlen_decode_kernel[(hkv, S)](
        q, q.stride(0),
        fp_keys, fp_keys.stride(0), fp_values, fp_values.stride(0), fp_offsets,
        *qargs,
        tail_keys, tail_keys.stride(0), tail_keys.stride(1),
        tail_values, tail_values.stride(0), tail_values.stride(1), T,
        fb, qb,
        out, out.stride(0),
        pm, pl, pacc,
        float(scale) * LOG2E, g, S,
        D=D, DV=dv,
        BLOCK_G=max(16, np2(g)), BLOCK_D=max(32, np2(D)), BLOCK_DV=max(32, block_dv),
        BLOCK_N=block_n, BLOCK_NQ=min(block_n, G), GROUP_Q=G, GROUP_V=gv, NGV_P2=ngv_p2,
        QUANT=quant, SPLIT=split, BIAS=has_bias, DOT_PREC="ieee" if dt == torch.float32 else "tf32",
        UPCAST=dt == torch.bfloat16 and _INTERPRETED,
        num_warps=num_warps or (8 if quant else 4), num_stages=num_stages,
    )
    if split:
        _combine_kernel[(H,)](pm, pl, pacc, out, out.stride(0), S,
                              DV=dv, BLOCK_S=max(2, np2(S)), BLOCK_DV=np2(dv), num_warps=4)
    return out
