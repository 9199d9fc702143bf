"""Triton kernel + launcher: one decode step over per-head variable-length KV whose body rows are in the compact
quantized layout of ``.kvpack`` (``format/SPEC.md`` §5.6, ``kvpack.compact``), dequantized on the fly.

Per KV head h the rows are [full-precision rows | compact body rows | dense tail]; the math and the split/combine
scheme are ``varlen_decode.py``'s (online softmax in base 2, FlashAttention arXiv 2205.14135 §3.1; flash-decoding
splits), with optional per-row logit biases (Attention Matching's beta). The compact body differs from KIVI's:

* keys: each row is one little-endian bit string of the head's channel codes, channel c taking ``w[h, c]`` bits
  at row bit ``o[h, c] = sum(w[h, :c])``; a code of w <= 8 bits lies in the 16-bit window of bytes ``o // 8`` and
  ``o // 8 + 1``: ``code = (window >> o % 8) & (2^w - 1)``;
* key group parameters are byte codes on the layer's per-column grids: ``min = code_min x step_c + base_c``,
  ``scale = scale_base_c x MULT[code_scale]`` (``MULT[0] = 0``; ``kvpack.compact.scale_table``); a head's last key
  group may be shorter than G (rows past the head's body are masked);
* values: uniform ``bits`` per code (int4: two per byte, even channel in the low nibble; int8: one byte), per-row
  groups of Gv channels with byte-coded parameters on the value columns' grids.

As in ``varlen_decode.py``, keys are never dequantized: within a group ``q . k_hat = (q * s) . code + q . m``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .varlen_decode import _INTERPRETED, LOG2E, _combine_kernel, _default_splits, _dot, _online_update


@triton.jit
def _dense_segment(m_i, l_i, acc, q, K, stride_kh, stride_kn, V, stride_vh, stride_vn, B, row0, n, s, start,
                   num_splits, qk_scale, offs_d, d_mask, offs_v, v_mask,
                   BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    # rows row0 .. row0 + n of K/V (already offset to the head), blocks start, start + S, ...
    nb = tl.cdiv(n, BLOCK_N)
    for b in range(start, nb, num_splits):
        offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n
        rows = row0 + offs_n
        k = tl.load(K + rows[:, None] * stride_kn + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        qk = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * qk_scale
        if HAS_BIAS:
            qk += tl.load(B + rows, mask=n_mask, other=0.0)[None, :] * 1.4426950408889634
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        v = tl.load(V + rows[:, None] * stride_vn + offs_v[None, :], mask=n_mask[:, None] & v_mask[None, :], other=0.0)
        m_i, l_i, acc = _online_update(m_i, l_i, acc, qk, v, DOT_PREC, UPCAST)
    return m_i, l_i, acc, nb


@triton.jit
def _compact_decode_kernel(
    Q, stride_q,
    FK, stride_fk, FV, stride_fv, FP_OFF, FB,      # fp rows (Nfp, D), (Nfp, Dv), (Hkv+1,), (Nfp,) biases
    KC, row_bytes, KOFF, KW, KP, n_groups, GRP_OFF, Q_OFF, QB,   # compact keys; (Hkv, D) x2 int32; (2, K, D) u8
    VC, VP, n_qrows, GRID, MULT,                   # (Q, Dv*VBITS/8) u8, (2, Q, NGV) u8, Q, (3, D + NGV) f32, (256,)
    TK, stride_tkh, stride_tkt, TV, stride_tvh, stride_tvt, T,
    O, stride_o, PM, PL, PACC,
    qk_scale, group, num_splits,
    D: tl.constexpr, DV: tl.constexpr, NGV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_NQ: tl.constexpr, GROUP_Q: tl.constexpr, GROUP_V: tl.constexpr, VBITS: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    h = tl.program_id(0)
    s = tl.program_id(1)
    dt = Q.dtype.element_ty
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < group
    qrows = (h * group + offs_g).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q = tl.load(Q + qrows[:, None] * stride_q + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    offs_v = tl.arange(0, BLOCK_DV)
    v_mask = offs_v < DV
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)

    # ---- segment 1: full-precision rows ----
    fp_lo = tl.load(FP_OFF + h).to(tl.int64)
    n_fp = (tl.load(FP_OFF + h + 1) - tl.load(FP_OFF + h)).to(tl.int32)
    m_i, l_i, acc, nb_fp = _dense_segment(m_i, l_i, acc, q, FK, 0, stride_fk, FV, 0, stride_fv, FB, fp_lo, n_fp, s, s,
                                          num_splits, qk_scale, offs_d, d_mask, offs_v, v_mask,
                                          BLOCK_N, HAS_BIAS, DOT_PREC, UPCAST)

    # ---- segment 2: compact body rows, dequantized on the fly ----
    qf = q.to(tl.float32)
    width = tl.load(KW + h * D + offs_d, mask=d_mask, other=0)
    bit0 = tl.load(KOFF + h * D + offs_d, mask=d_mask, other=0)
    byte0 = bit0 >> 3
    shift = bit0 & 7
    cmask = (1 << width) - 1
    k_base = tl.load(GRID + offs_d, mask=d_mask, other=0.0)
    k_step = tl.load(GRID + (D + NGV) + offs_d, mask=d_mask, other=0.0)
    k_sbase = tl.load(GRID + 2 * (D + NGV) + offs_d, mask=d_mask, other=0.0)
    offs_cv = tl.arange(0, BLOCK_DV // (8 // VBITS))
    cv_mask = offs_cv < DV * VBITS // 8
    offs_sg = tl.arange(0, NGV)
    v_base = tl.load(GRID + D + offs_sg)
    v_step = tl.load(GRID + (D + NGV) + D + offs_sg)
    v_sbase = tl.load(GRID + 2 * (D + NGV) + D + offs_sg)
    q_lo = tl.load(Q_OFF + h).to(tl.int64)
    n_q = (tl.load(Q_OFF + h + 1) - tl.load(Q_OFF + h)).to(tl.int32)
    g_lo = tl.load(GRP_OFF + h).to(tl.int64)
    nb_q = tl.cdiv(n_q, BLOCK_NQ)
    start_q = (s - nb_fp % num_splits + num_splits) % num_splits
    for b in range(start_q, nb_q, num_splits):
        in_head = b * BLOCK_NQ + tl.arange(0, BLOCK_NQ)
        r_mask = in_head < n_q
        rows = q_lo + in_head
        grp = g_lo + (b * BLOCK_NQ) // GROUP_Q                       # the block lies in one key group
        code_min = tl.load(KP + grp * D + offs_d, mask=d_mask, other=0).to(tl.float32)
        code_scale = tl.load(KP + (n_groups + grp) * D + offs_d, mask=d_mask, other=0).to(tl.int32)
        km = code_min * k_step + k_base
        ks = k_sbase * tl.load(MULT + code_scale)
        lo = tl.load(KC + rows[:, None] * row_bytes + byte0[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0)
        hi = tl.load(KC + rows[:, None] * row_bytes + byte0[None, :] + 1,
                     mask=r_mask[:, None] & d_mask[None, :] & (byte0[None, :] + 1 < row_bytes), other=0)
        window = lo.to(tl.int32) | (hi.to(tl.int32) << 8)
        codes = ((window >> shift[None, :]) & cmask[None, :]).to(tl.float32).to(dt)   # (BN, BLOCK_D), exact
        qk = _dot((qf * ks[None, :]).to(dt), tl.trans(codes), DOT_PREC, UPCAST)
        qk = (qk + tl.sum(qf * km[None, :], 1)[:, None]) * qk_scale
        if HAS_BIAS:
            qk += tl.load(QB + rows, mask=r_mask, other=0.0)[None, :] * 1.4426950408889634
        qk = tl.where(r_mask[None, :], qk, float("-inf"))
        vc = tl.load(VC + rows[:, None] * (DV * VBITS // 8) + offs_cv[None, :], mask=r_mask[:, None] & cv_mask[None, :],
                     other=0)
        if VBITS == 4:
            vcodes = tl.interleave(vc & 15, vc >> 4).to(tl.float32)                  # (BN, BLOCK_DV)
        else:
            vcodes = vc.to(tl.float32)
        sp = rows[:, None] * NGV + offs_sg[None, :]
        vmin = tl.load(VP + sp, mask=r_mask[:, None], other=0).to(tl.float32) * v_step[None, :] + v_base[None, :]
        vsc = v_sbase[None, :] * tl.load(MULT + tl.load(VP + n_qrows * NGV + sp, mask=r_mask[:, None],
                                                        other=0).to(tl.int32))
        if NGV == 1:
            vm_b = vmin
            vs_b = vsc
        else:
            vm_b = tl.reshape(tl.broadcast_to(vmin[:, :, None], (BLOCK_NQ, NGV, GROUP_V)), (BLOCK_NQ, BLOCK_DV))
            vs_b = tl.reshape(tl.broadcast_to(vsc[:, :, None], (BLOCK_NQ, NGV, GROUP_V)), (BLOCK_NQ, BLOCK_DV))
        v = (vcodes * vs_b + vm_b).to(dt)
        m_i, l_i, acc = _online_update(m_i, l_i, acc, qk, v, DOT_PREC, UPCAST)

    # ---- segment 3: dense tail ----
    start_t = (s - (nb_fp + nb_q) % num_splits + num_splits) % num_splits
    m_i, l_i, acc, _ = _dense_segment(m_i, l_i, acc, q, TK + h * stride_tkh, 0, stride_tkt,
                                      TV + h * stride_tvh, 0, stride_tvt, FB, 0, T, s, start_t, num_splits, qk_scale,
                                      offs_d, d_mask, offs_v, v_mask, BLOCK_N, False, DOT_PREC, UPCAST)
    if SPLIT:
        pr = qrows * num_splits + s
        tl.store(PM + pr, m_i, mask=g_mask)
        tl.store(PL + pr, l_i, mask=g_mask)
        tl.store(PACC + pr[:, None] * DV + offs_v[None, :], acc, mask=g_mask[:, None] & v_mask[None, :])
    else:
        inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(O + qrows[:, None] * stride_o + offs_v[None, :], (acc * inv[:, None]).to(dt),
                 mask=g_mask[:, None] & v_mask[None, :])


_MULTIPLIERS: dict = {}  # device -> the table, so a decode loop makes no host-to-device copy per launch


def scale_multipliers(device) -> torch.Tensor:
    """``[256]`` float32: the multiplier of a column's scale base for each scale code, ``(32 + m) x 2^(e - 12)``
    for code ``e << 5 | m`` and 0 for code 0 (``kvpack.compact.scale_table``; ``format/SPEC.md`` §5.6). Made once
    per device; treat it as read-only."""
    device = torch.device(device)
    if device not in _MULTIPLIERS:
        k = torch.arange(256)
        mult = (32 + (k & 31)).double() * torch.pow(2.0, (k >> 5).double() - 12)
        mult[0] = 0.0
        _MULTIPLIERS[device] = mult.float().to(device)
    return _MULTIPLIERS[device]


def compact_decode_triton(q, fp_keys, fp_values, fp_offsets, tail_keys, tail_values, scale, *, key_codes, key_bits,
                          key_params, value_codes, value_params, quant_grid, q_offsets, group_offsets, group_size,
                          bits, fp_biases=None, q_biases=None, num_splits=None, block_n=64, num_warps=4,
                          num_stages=2):
    """One decode step over [fp rows | compact body rows | tail] per KV head. -> ``[H, Dv]`` in q's dtype.

    Args (one layer; H query heads, Hkv KV heads, D / Dv head dims, Q body rows, K key groups):
        q ``[H, D]``; fp_keys ``[Nfp, D]``, fp_values ``[Nfp, Dv]`` (q's dtype), fp_offsets ``[Hkv + 1]``;
        tail_keys ``[Hkv, T, D]``, tail_values ``[Hkv, T, Dv]``; scale: softmax temperature.
        key_codes ``[Q, bits x D / 8]`` uint8 (bit strings of ``key_bits`` ``[Hkv, D]`` widths), key_params
        ``[2, K, D]`` uint8 (min codes, scale codes), value_codes ``[Q, Dv x bits / 8]`` uint8, value_params
        ``[2, Q, Dv / Gv]`` uint8, quant_grid ``[3, D + Dv / Gv]`` float32 (min base, min step, scale base):
        ``kvpack.pack.QuantizedRows``'s compact fields; q_offsets ``[Hkv + 1]`` body rows and group_offsets
        ``[Hkv + 1]`` key groups of each head; group_size G (a power of two >= 16); bits 4 or 8.
        fp_biases ``[Nfp]``, q_biases ``[Q]``: optional float32 logit biases.

    Raises ``ValueError`` for a layout the kernel cannot take (shapes, G, bits, Dv not a power of two).
    """
    H, D = q.shape
    hkv = fp_offsets.numel() - 1
    dv = fp_values.shape[1]
    T = tail_keys.shape[1]
    G = int(group_size)
    gv = min(G, dv)
    ngv = dv // gv
    nq = key_codes.shape[0]
    dt = q.dtype
    if G < 16 or G & (G - 1) or dv & (dv - 1) or bits not in (4, 8) or hkv < 1 or H % hkv:
        raise ValueError(f"compact decode needs G a power of two >= 16, Dv a power of two, bits 4 or 8 and H a "
                         f"multiple of Hkv; got G={G}, Dv={dv}, bits={bits}, H={H}, Hkv={hkv}")
    expect = {"key_codes": (nq, bits * D // 8), "key_bits": (hkv, D), "value_codes": (nq, dv * bits // 8),
              "value_params": (2, nq, ngv), "quant_grid": (3, D + ngv), "tail_keys": (hkv, T, D),
              "fp_keys": (fp_values.shape[0], D)}
    given = {"key_codes": key_codes, "key_bits": key_bits, "value_codes": value_codes, "value_params": value_params,
             "quant_grid": quant_grid, "tail_keys": tail_keys, "fp_keys": fp_keys}
    for name, shape in expect.items():
        if tuple(given[name].shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(given[name].shape)}")
    if key_params.dim() != 3 or key_params.shape[0] != 2 or key_params.shape[2] != D:
        raise ValueError(f"key_params: expected shape (2, K, {D}), got {tuple(key_params.shape)}")
    widths = key_bits.to(device=q.device, dtype=torch.int32).contiguous()
    offsets = (torch.cumsum(widths, 1) - widths).to(torch.int32).contiguous()
    has_bias = fp_biases is not None or q_biases is not None
    fb = fp_biases if fp_biases is not None else torch.zeros(fp_keys.shape[0], device=q.device)
    qb = q_biases if q_biases is not None else torch.zeros(nq, device=q.device)
    rows_per_head = (fp_keys.shape[0] + nq) / hkv + T
    S = num_splits or _default_splits(q, hkv, rows_per_head, block_n)
    out = torch.empty(H, dv, dtype=dt, device=q.device)
    if S > 1:
        pm = torch.empty(H, S, dtype=torch.float32, device=q.device)
        pl = torch.empty(H, S, dtype=torch.float32, device=q.device)
        pacc = torch.empty(H, S, dv, dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = out
    np2 = triton.next_power_of_2
    _compact_decode_kernel[(hkv, S)](
        q, q.stride(0), fp_keys, fp_keys.stride(0), fp_values, fp_values.stride(0), fp_offsets, fb.float().contiguous(),
        key_codes.contiguous(), key_codes.shape[1], offsets, widths, key_params.contiguous(), key_params.shape[1],
        group_offsets, q_offsets, qb.float().contiguous(),
        value_codes.contiguous(), value_params.contiguous(), nq, quant_grid.float().contiguous(),
        scale_multipliers(q.device),
        tail_keys, tail_keys.stride(0), tail_keys.stride(1), tail_values, tail_values.stride(0), tail_values.stride(1), T,
        out, out.stride(0), pm, pl, pacc,
        float(scale) * LOG2E, H // hkv, S,
        D=D, DV=dv, NGV=ngv, BLOCK_G=max(16, np2(H // hkv)), BLOCK_D=max(32, np2(D)), BLOCK_DV=max(32, dv),
        BLOCK_N=block_n, BLOCK_NQ=min(block_n, G), GROUP_Q=G, GROUP_V=gv, VBITS=int(bits),
        SPLIT=S > 1, HAS_BIAS=has_bias, DOT_PREC="ieee" if dt == torch.float32 else "tf32",
        UPCAST=dt == torch.bfloat16 and _INTERPRETED,
        num_warps=num_warps, num_stages=num_stages,
    )
    if S > 1:
        _combine_kernel[(H,)](pm, pl, pacc, out, out.stride(0), S, DV=dv, BLOCK_S=max(2, np2(S)), BLOCK_DV=np2(dv),
                              num_warps=4)
    return out
