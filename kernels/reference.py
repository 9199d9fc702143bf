"""Plain PyTorch reference for one decode step over per-head variable-length KV (also the CPU path).

Layout (one layer, batch 1, one new query token; see kernels/README.md):
  q            [H, D]            query heads; query head j reads KV head j // g, g = H // Hkv (GQA)
  fp_keys      [Nfp, D]          full-precision rows; KV head h owns rows fp_offsets[h]:fp_offsets[h+1]
  fp_values    [Nfp, Dv]
  fp_offsets   [Hkv+1] int       non-decreasing
  key_codes    [Q, D/2] uint8    int4 rows (KIVI, arXiv 2402.02750); byte = even channel | odd channel << 4
  key_scales   [Q/G, D] fp16     keys: per channel over groups of G consecutive rows (group = row // G)
  key_mins     [Q/G, D] fp16
  value_codes  [Q, Dv/2] uint8
  value_scales [Q, Dv/Gv] fp16   values: per token over groups of Gv = min(G, Dv) channels
  value_mins   [Q, Dv/Gv] fp16
  q_offsets    [Hkv+1] int       KV head h owns int4 rows q_offsets[h]:q_offsets[h+1] (multiples of G)
  tail_keys    [Hkv, T, D]       dense tail (new tokens; the current token is the last row), T >= 0
  tail_values  [Hkv, T, Dv]
  fp_biases    [Nfp] fp32        optional additive logit bias of each fp row (Attention Matching's beta; None = 0)
  q_biases     [Q] fp32          optional bias of each int4 row; the tail has none
Dequantized x_hat = code * scale + min. A head with no visible entry outputs zeros.
"""

from __future__ import annotations

import torch


def unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, C/2] uint8 -> [N, C] uint8 codes; low nibble is the even channel, high nibble the odd one."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, C] integer codes in 0..15 (C even) -> [N, C/2] uint8."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def value_group_size(group_size: int, dv: int) -> int:
    """Gv = min(G, Dv): the number of channels sharing one value scale."""
    return min(group_size, dv)


def dequantize_int4_keys(codes, scales, mins, group_size: int) -> torch.Tensor:
    """Keys, per channel over groups of `group_size` rows: [Q, D/2] uint8, [Q/G, D] x2 -> [Q, D] float32."""
    c = unpack_int4(codes).float()  # (Q, D)
    s = scales.float().repeat_interleave(group_size, dim=0)  # (Q, D)
    m = mins.float().repeat_interleave(group_size, dim=0)
    return c * s + m


def dequantize_int4_values(codes, scales, mins, group_size: int) -> torch.Tensor:
    """Values, per token over groups of Gv = min(G, Dv) channels: [Q, Dv/2], [Q, Dv/Gv] x2 -> [Q, Dv] float32."""
    c = unpack_int4(codes).float()  # (Q, Dv)
    gv = value_group_size(group_size, c.shape[1])
    return c * scales.float().repeat_interleave(gv, dim=1) + mins.float().repeat_interleave(gv, dim=1)


def _quantize(x: torch.Tensor, dim: int):
    """Asymmetric 4-bit min/max quantization of x reduced over `dim` (KIVI)."""
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    codes = ((x - lo) / scale).round().clamp(0, 15)
    return codes, scale.half(), lo.half()


def quantize_int4_keys(keys: torch.Tensor, group_size: int):
    """[Q, D] (Q a multiple of G; groups must not straddle heads) -> codes [Q, D/2], scales, mins [Q/G, D]."""
    q, d = keys.shape
    codes, s, m = _quantize(keys.float().view(q // group_size, group_size, d), dim=1)
    return pack_int4(codes.view(q, d)), s.view(-1, d), m.view(-1, d)


def quantize_int4_values(values: torch.Tensor, group_size: int):
    """[Q, Dv] -> codes [Q, Dv/2], scales, mins [Q, Dv/Gv]."""
    q, dv = values.shape
    gv = value_group_size(group_size, dv)
    codes, s, m = _quantize(values.float().view(q, dv // gv, gv), dim=2)
    return pack_int4(codes.view(q, dv)), s.view(q, dv // gv), m.view(q, dv // gv)


def varlen_decode_reference(q, fp_keys, fp_values, fp_offsets, tail_keys, tail_values, scale,
                            key_codes=None, key_scales=None, key_mins=None,
                            value_codes=None, value_scales=None, value_mins=None,
                            q_offsets=None, group_size=None, fp_biases=None, q_biases=None) -> torch.Tensor:
    """softmax(q . k * scale + beta) @ v per head over [fp rows | int4 rows | tail], in float32 (beta: the rows'
    biases, 0 for the tail). -> [H, Dv] in q.dtype."""
    hkv = fp_offsets.numel() - 1
    h, dv = q.shape[0], fp_values.shape[1]
    g = h // hkv
    quant = key_codes is not None
    if quant:
        kq = dequantize_int4_keys(key_codes, key_scales, key_mins, group_size)
        vq = dequantize_int4_values(value_codes, value_scales, value_mins, group_size)
    fo = fp_offsets.tolist()
    qo = q_offsets.tolist() if quant else None
    out = torch.zeros(h, dv, dtype=torch.float32, device=q.device)
    for kv in range(hkv):
        ks = [fp_keys[fo[kv]:fo[kv + 1]].float()]
        vs = [fp_values[fo[kv]:fo[kv + 1]].float()]
        bs = [_bias(fp_biases, fo[kv], fo[kv + 1], q.device)]
        if quant:
            ks.append(kq[qo[kv]:qo[kv + 1]])
            vs.append(vq[qo[kv]:qo[kv + 1]])
            bs.append(_bias(q_biases, qo[kv], qo[kv + 1], q.device))
        ks.append(tail_keys[kv].float())
        vs.append(tail_values[kv].float())
        bs.append(torch.zeros(tail_keys.shape[1], device=q.device))
        k, v, b = torch.cat(ks), torch.cat(vs), torch.cat(bs)  # (N_h, D), (N_h, Dv), (N_h,)
        if k.shape[0] == 0:
            continue  # nothing visible: zeros, not NaN
        rows = slice(kv * g, (kv + 1) * g)
        probs = (q[rows].float() @ k.T * scale + b).softmax(dim=-1)  # (g, N_h)
        out[rows] = probs @ v
    return out.to(q.dtype)


def _bias(bias, start, stop, device):
    """Rows ``start:stop`` of an optional ``[N]`` bias as float32 (zeros when ``bias`` is None)."""
    if bias is None:
        return torch.zeros(stop - start, device=device)
    return bias[start:stop].float()
