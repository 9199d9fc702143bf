"""Model fingerprints: what a pack records about the model it was built with, and the check on load."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from .errors import ModelMismatchError
from .model import model_spec

__all__ = ["model_fingerprint", "tokenizer_sha256", "weights_sha256", "check_fingerprint"]

#: Fingerprint fields that may differ between the building and the loading model (the KV is cast on load).
_INFORMATIVE = ("dtype", "name")

_SAMPLES_PER_TENSOR = 64
#: Largest integer range float32 counts exactly (2^24).
_FLOAT32_EXACT = 1 << 24


def tokenizer_sha256(tokenizer) -> str:
    """SHA-256 (hex) of the tokenizer's vocabulary, special tokens and chat template (cached on the tokenizer)."""
    cached = getattr(tokenizer, "_kvpack_sha256", None)
    if cached is not None:
        return cached
    vocab = sorted(tokenizer.get_vocab().items())
    payload = {
        "vocab": vocab,
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": getattr(tokenizer, "chat_template", None) or "",
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    tokenizer._kvpack_sha256 = digest
    return digest


@torch.no_grad()
def weights_sha256(model) -> str:
    """A cheap SHA-256 (hex) of the weights: names, shapes and 64 evenly spaced values of every tensor.

    Values are rounded to bfloat16 before hashing, so a model loaded in float32 or bfloat16 (or float16 from a
    bfloat16 checkpoint) gives the same hash. Cost: one small gather per tensor (milliseconds); computed once
    per model object and cached on it (the hash identifies which model was loaded, not later weight edits).
    """
    cached = getattr(model, "_kvpack_weights_sha256", None)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        h.update(f"{name}:{tuple(tensor.shape)};".encode())
        if flat.numel() == 0 or not flat.is_floating_point():
            continue
        idx = _sample_indices(flat.numel())
        sample = flat[idx.to(flat.device)].to(torch.bfloat16).view(torch.int16).cpu().numpy()
        h.update(sample.tobytes())
    model._kvpack_weights_sha256 = h.hexdigest()
    return model._kvpack_weights_sha256


def _sample_indices(numel: int) -> torch.Tensor:
    """``min(64, numel)`` evenly spaced int64 indices into a flat tensor of ``numel`` elements, first and last included.

    Up to 2^24 elements the indices are float32 ``linspace``'s (the packs written so far hash those); beyond, float32
    cannot address every element (it rounded the last index of a 28,311,552-element embedding past the end), so the
    spacing is computed in float64, exact to 2^53.
    """
    dtype = torch.float32 if numel <= _FLOAT32_EXACT else torch.float64
    return torch.linspace(0, numel - 1, min(_SAMPLES_PER_TENSOR, numel), dtype=dtype).long()


def model_fingerprint(model, tokenizer, kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Everything that must match for a pack to be valid in a model: a JSON-serialisable dict (a fresh copy).

    Fields: ``architecture`` (class name), ``model_type``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``rope`` (the config's RoPE type, theta and scaling), ``sliding_layers``, ``sliding_window``,
    ``vocab_size``, ``tokenizer_sha256``, ``weights_sha256``; informative only: ``dtype`` of the stored KV and
    ``name`` (the path or id the model was loaded from).

    The model's fields are read once per model object and tokenizer and cached on the model, like
    ``weights_sha256``: the fingerprint identifies the model that was loaded, not later edits of its config.
    """
    return json.loads(json.dumps(_cached_fingerprint(model, tokenizer, kv_dtype)))


def _cached_fingerprint(model, tokenizer, kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``model_fingerprint`` without the copy: a dict shared between calls, which callers must not modify.

    Cached on the model per ``(tokenizer hash, KV dtype, model dtype)``; ``kvpack.load`` compares it with a
    pack's fingerprint on every load, so it must not cost a config walk each time.
    """
    tok_sha = tokenizer_sha256(tokenizer) if tokenizer is not None else None
    key = (tok_sha, kv_dtype, model.dtype)
    cache = model.__dict__.setdefault("_kvpack_fingerprints", {})
    if key not in cache:
        cache[key] = _fingerprint(model, tok_sha, kv_dtype)
    return cache[key]


def _fingerprint(model, tok_sha: str | None, kv_dtype: torch.dtype | None) -> dict[str, Any]:
    """The fingerprint of ``model`` (see ``model_fingerprint``), computed from its config and weights."""
    spec = model_spec(model)
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = {k: v for k, v in dict(rope).items() if isinstance(v, (int, float, str, bool, list, type(None)))}
    return {
        "architecture": type(model).__name__,
        "model_type": cfg.model_type,
        "num_layers": spec.num_layers,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rope": json.loads(json.dumps(rope, sort_keys=True)),
        "sliding_layers": list(spec.sliding_layers),
        "sliding_window": spec.sliding_window,
        "vocab_size": int(cfg.vocab_size),
        "tokenizer_sha256": tok_sha,
        "weights_sha256": weights_sha256(model),
        "dtype": str(kv_dtype or model.dtype).replace("torch.", ""),
        "name": getattr(model, "kvpack_name", None) or getattr(cfg, "_name_or_path", "") or "",
    }


def _describe(fp: dict[str, Any]) -> str:
    return (
        f"{fp.get('name') or '?'} ({fp.get('architecture')}, {fp.get('num_layers')} layers, "
        f"{fp.get('num_heads')}/{fp.get('num_kv_heads')} heads, weights {str(fp.get('weights_sha256'))[:12]})"
    )


_PACK_FIX = "Load it with the model it was built for, or rebuild it with `kvpack build --model ...`"


def check_fingerprint(stored: dict[str, Any], current: dict[str, Any], *, path: str = "the pack",
                      fix: str = _PACK_FIX) -> None:
    """Raise ``ModelMismatchError`` naming both models if ``stored`` and ``current`` differ in any required field.

    The tokenizer is compared only when both fingerprints carry its hash. When only the weights hash differs and the
    dtypes differ too (a float16 model against a bfloat16 pack rounds the sampled weights differently), the message
    names both dtypes and the ``--dtype`` that fixes it. ``fix`` ends the message otherwise (default: how to load or
    rebuild a pack).
    """
    diffs = []
    for key in sorted(set(stored) | set(current)):
        if key in _INFORMATIVE:
            continue
        a, b = stored.get(key), current.get(key)
        if key == "tokenizer_sha256" and (a is None or b is None):
            continue
        if a != b:
            diffs.append(key)
    a, b = stored.get("dtype"), current.get("dtype")
    if diffs and a and b and a != b and set(diffs) <= {"weights_sha256"}:
        raise ModelMismatchError(
            f"{path} was built with the model in {a} but the model given is loaded in {b}; the dtypes differ "
            f"(the weights match up to that rounding). Fix: load the model in {a} (`--dtype {a}`, or "
            f"`kvpack.load_model(..., dtype=\"{a}\")`), or rebuild the pack with `kvpack build --dtype {b}`"
        )
    if diffs:
        raise ModelMismatchError(
            f"{path} was built for model {_describe(stored)} but the model given is {_describe(current)}; "
            f"they differ in: {', '.join(diffs)}. {fix}"
        )
