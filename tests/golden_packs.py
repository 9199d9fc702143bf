"""Hand-made, deterministic Packs behind the golden files in ``format/golden/``.

Regenerate the golden files (only after an intended format change, then review the diff and the spec):

    python -m tests.golden_packs          # from the repository root

Every value is exactly representable in float16 and bfloat16, so no rounding depends on the platform.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvpack.fileformat import save
from kvpack.pack import LayerEntries, Pack

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
        "layout": {"question_prefix": "\n\nQuestion: ", "question_suffix": ""},
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


#: Golden file name -> the Pack it holds.
GOLDEN = {
    "small_f32.kvpack": golden_f32,
    "small_bf16.kvpack": golden_bf16,
    "small_f16_narrow_values.kvpack": golden_f16_narrow_values,
}


def regenerate(folder: Path = GOLDEN_DIR) -> list[Path]:
    """Rewrite every golden file in ``folder`` from its Pack; return the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, make in GOLDEN.items():
        save(make(), folder / name)
        paths.append(folder / name)
    return paths


if __name__ == "__main__":
    for path in regenerate():
        print(f"wrote {path} ({path.stat().st_size} bytes)")
