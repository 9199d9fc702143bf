"""Hand-made, deterministic Packs behind the golden files of format 1.0 in ``format/golden/``.

Regenerate the golden files (only after an intended format change, then review the diff and the spec):

    python -m tests.golden_packs          # from the repository root

Every value is exactly representable in float16 and bfloat16, so no rounding depends on the platform.
``GOLDEN`` maps each file name to ``(the Pack it holds, zstd level, tensor checksum)``. zstd's output depends on
the zstd library, so the exact bytes of the zstd files are pinned for ``GOLDEN_ZSTD_LIBRARY`` only (reading them
works with any).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvpack.fileformat import save
from kvpack.pack import LayerEntries, Pack
from kvpack.quant import quantize_pack

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "format" / "golden"


def _layer(
    head_positions: list[list[int]], head_dim: int, head_dim_v: int, dtype: torch.dtype, seed: int
) -> LayerEntries:
    """Entries whose key/value at row r, column c is a small multiple of 1/4 derived from (seed, r, c)."""
    positions = [p for head in head_positions for p in head]
    n = len(positions)
    rows = torch.arange(n, dtype=torch.float32)[:, None]
    keys = (seed + rows * head_dim + torch.arange(head_dim, dtype=torch.float32)) / 4 - 8
    values = -(seed + rows * head_dim_v + torch.arange(head_dim_v, dtype=torch.float32)) / 4 + 4
    return LayerEntries(
        keys=keys.to(dtype),
        values=values.to(dtype),
        positions=torch.tensor(positions, dtype=torch.int32),
        head_lengths=torch.tensor([len(h) for h in head_positions], dtype=torch.int64),
    )


def _metadata(method: str, ratio: float, layers: int) -> dict:
    """The documented ``Pack.metadata`` keys with illustrative values (a non-ASCII name pins the JSON escaping)."""
    return {
        "method": method,
        "method_params": {"window": 2},
        "ratio": ratio,
        "fingerprint": {"model": "golden-toy", "num_layers": layers, "kv_heads": 2, "head_dim": 4},
        "source": {"name": "notes-é.txt", "sha256": "0" * 64},
        "layout": {"prefix": "<s>", "separator": "\n\nQuestion: ", "turn_end": "\nAnswer:", "templated": False},
        "layer_kinds": ["compressed"] * layers,
        "kvpack_version": "0.1.0",
        "stats": {"kept_entries": 0, "note": "hand-made"},
    }


def golden_f32() -> Pack:
    """2 layers x 2 KV heads x head_dim 4, float32, 8 tokens, 2 sink tokens; head 1 of layer 1 keeps 0 entries."""
    layers = [
        _layer([[0, 1, 4, 6], [0, 1, 7]], 4, 4, torch.float32, seed=0),
        _layer([[0, 1, 2, 3, 5], []], 4, 4, torch.float32, seed=3),
    ]
    return Pack(
        token_ids=torch.tensor([1, 5, 9, 300, 70000, 2, 0, 2**31 - 1], dtype=torch.int64),
        layers=layers,
        sink_tokens=2,
        metadata=_metadata("keynorm", 0.5, 2),
    )


def golden_bf16() -> Pack:
    """2 layers x 2 KV heads x head_dim 4, bfloat16, 6 tokens, no sink; layer 0 keeps 0 entries (a zero-size layer)."""
    layers = [
        _layer([[], []], 4, 4, torch.bfloat16, seed=0),
        _layer([[0, 2, 5], [1, 3]], 4, 4, torch.bfloat16, seed=1),
    ]
    return Pack(
        token_ids=torch.arange(10, 16, dtype=torch.int64),
        layers=layers,
        sink_tokens=0,
        metadata=_metadata("snapkv", 0.25, 2),
    )


def golden_f16_narrow_values() -> Pack:
    """3 layers x 2 KV heads, float16 keys with head_dim 4 and values with head_dim_v 2, 5 tokens, 1 sink token."""
    layers = [_layer([[0, 3], [0, 1, 2, 3, 4]], 4, 2, torch.float16, seed=l) for l in range(3)]
    return Pack(
        token_ids=torch.tensor([7, 7, 7, 8, 9], dtype=torch.int64),
        layers=layers,
        sink_tokens=1,
        metadata=_metadata("expected_attention", 0.75, 3),
    )


def _quant_layer(head_positions: list[list[int]], seed: int) -> LayerEntries:
    """float16 entries, head_dim 4 / head_dim_v 4: multiples of 1/4 in [-2, 2] from (seed, row, column), key
    channel 3 constant (a scale-0 group), and one outlier (24.0) in key channel 0 and value channel 2 of row 5."""
    positions = [p for head in head_positions for p in head]
    n = len(positions)
    r = torch.arange(n)[:, None]
    c = torch.arange(4)[None, :]
    keys = ((r * 7 + c * 13 + seed) % 17 - 8).float() / 4
    values = ((r * 5 + c * 11 + 3 * seed) % 13 - 6).float() / 4
    keys[:, 3] = 1.5
    if n > 5:
        keys[5, 0] = 24.0
        values[5, 2] = 24.0
    return LayerEntries(
        keys=keys.to(torch.float16),
        values=values.to(torch.float16),
        positions=torch.tensor(positions, dtype=torch.int32),
        head_lengths=torch.tensor([len(h) for h in head_positions], dtype=torch.int64),
    )


def golden_unquantized_for_int() -> Pack:
    """2 layers x 2 KV heads x head_dim 4, float16, 48 tokens, 2 sink tokens; with group size 32 the heads have
    (sink, quantized, residual) rows: layer 0 (2, 32, 4) and (2, 0, 3) (too short: not quantized), layer 1
    (2, 32, 14) and (0, 32, 1) (a head without sink rows)."""
    layers = [
        _quant_layer([[0, 1, *range(2, 38)], [0, 1, 5, 9, 40]], seed=0),
        _quant_layer([list(range(48)), list(range(3, 36))], seed=1),
    ]
    return Pack(
        token_ids=torch.arange(100, 148, dtype=torch.int64),
        layers=layers,
        sink_tokens=2,
        metadata=_metadata("kvzip", 0.5, 2),
    )


#: Query energy behind the quantized golden files' key code widths: per layer ``[kv_heads, head_dim]``; layer 1's
#: head 1 has none (uniform widths).
GOLDEN_QUERY_ENERGY = (((4.0, 1.0, 0.25, 1.0), (1.0, 1.0, 1.0, 1.0)), ((0.5, 2.0, 8.0, 1.0), (0.0, 0.0, 0.0, 0.0)))


def golden_int4() -> Pack:
    """``golden_unquantized_for_int`` quantized to int4, group size 32, in the compact layout with the key code
    widths of ``GOLDEN_QUERY_ENERGY``. (sink, quantized, full-precision) rows per head: layer 0 (2, 36, 0) (a 4-row
    last group) and (2, 0, 3) (too short), layer 1 (2, 46, 0) and (0, 33, 0) (a 1-row group)."""
    energy = [torch.tensor(e, dtype=torch.float64) for e in GOLDEN_QUERY_ENERGY]
    return quantize_pack(golden_unquantized_for_int(), "int4", 32, energy)


def golden_int8() -> Pack:
    """``golden_unquantized_for_int`` quantized to int8, group size 32 (uniform 8-bit key widths)."""
    return quantize_pack(golden_unquantized_for_int(), "int8", 32)


def golden_f32_biases() -> Pack:
    """``golden_f32`` with attention biases on layer 0 only (layer 1 has none: stored as zeros), spanning the
    allowed range: ``[-30, -0.5, 0, 2.25]`` for head 0 and ``[30, 1, -1]`` for head 1."""
    pack = golden_f32()
    pack.layers[0].biases = torch.tensor([-30.0, -0.5, 0.0, 2.25, 30.0, 1.0, -1.0])
    return pack


#: Golden file name -> (the Pack it holds, the zstd level, the tensor checksum it is saved with).
GOLDEN = {
    "small_f32.kvpack": (golden_f32, 0, "xxh3"),
    "small_bf16.kvpack": (golden_bf16, 0, "xxh3"),
    "small_f16_narrow_values.kvpack": (golden_f16_narrow_values, 0, "xxh3"),
    "small_f32_sha256.kvpack": (golden_f32, 0, "sha256"),
    "small_f32_zstd.kvpack": (golden_f32, 3, "xxh3"),
    "small_f32_biases.kvpack": (golden_f32_biases, 0, "xxh3"),
    "small_int4.kvpack": (golden_int4, 0, "xxh3"),
    "small_int8.kvpack": (golden_int8, 0, "xxh3"),
    "small_int4_zstd.kvpack": (golden_int4, 3, "xxh3"),
}

#: ``zstandard.ZSTD_VERSION`` of the zstd library that wrote the zstd golden files.
GOLDEN_ZSTD_LIBRARY = (1, 5, 7)


def regenerate(folder: Path = GOLDEN_DIR) -> list[Path]:
    """Rewrite every golden file in ``folder`` from its Pack, removing the others; return the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.kvpack"):
        if old.name not in GOLDEN:
            old.unlink()
    paths = []
    for name, (make, level, checksum) in GOLDEN.items():
        save(make(), folder / name, zstd_level=level, checksum=checksum)
        paths.append(folder / name)
    return paths


if __name__ == "__main__":
    for path in regenerate():
        print(f"wrote {path} ({path.stat().st_size} bytes)")
