"""Attention Matching's per-model head schedules: what share of a keep ratio each (compressed layer, KV head) gets
(``--budgets schedule --schedule FILE``; ``kvpack.methods.budgets.scheduled_split``). The official code's headline
runs read such a schedule (``--precomputed-budget-path``), made once per model by ``head_budget_optimization/``
(arXiv 2602.16284 §4; github.com/adamzweiger/compaction).

The file is safetensors (never pickle), written atomically: one tensor ``fractions`` (``[compressed_layers,
kv_heads]`` float32, non-negative, finite, positive sum: each head's share of the budget, normalised on use) and
string metadata ``format`` (``"kvpack-head-schedule"``), ``version`` (``"1"``), JSON ``fingerprint`` (the model's,
``kvpack.fingerprint``), ``compressed_layers`` and ``source`` (free JSON: how the schedule was made).
``load_schedule`` treats the file as hostile as ``kvpack.heads.load_head_scores`` does (size cap, safetensors'
checks, every name, dtype, shape, value and field checked); ``check_schedule`` refuses it for another model.

``schedule_from_scores`` makes one from KVzip entry scores of a few contexts: each head's mean share of the capped
global top-k (``budgets.capped_top_k``) over the contexts, a cheap stand-in for the official influence-based solver
(``kvpack.schedule_solver``, which measures each head's effect on a continuation loss). ``kvpack schedule`` makes
either (``--solver influence|scores``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from . import storage
from .errors import InputError, ModelMismatchError
from .fingerprint import check_fingerprint, model_fingerprint
from .heads import _json_field, check_layers_field, read_safetensors

__all__ = ["HeadSchedule", "save_schedule", "load_schedule", "check_schedule", "schedule_from_scores",
           "SCHEDULE_FORMAT", "SCHEDULE_VERSION", "MAX_SCHEDULE_FILE_BYTES"]

SCHEDULE_FORMAT = "kvpack-head-schedule"
SCHEDULE_VERSION = "1"
#: Largest schedule file read (a 100-layer x 64-head model is 26 KB).
MAX_SCHEDULE_FILE_BYTES = 4 * 2**20
_MAKE_IT = "make one with `kvpack schedule DOC.txt ... --model M --ratio R --out schedule.safetensors`"


@dataclass
class HeadSchedule:
    """A head schedule of one model.

    Attributes:
        fractions: ``[compressed_layers, kv_heads]`` float32, each head's share of the budget (non-negative).
        compressed_layers: the layer index of each row.
        fingerprint: the model's (``kvpack.fingerprint.model_fingerprint``).
        source: how it was made (free JSON object).
    """

    fractions: torch.Tensor
    compressed_layers: list[int]
    fingerprint: dict[str, Any]
    source: dict[str, Any] = field(default_factory=dict)


def schedule_from_scores(scores: list[torch.Tensor], ratio: float, cap: float, compressed_layers: list[int],
                         fingerprint: dict, source: dict | None = None) -> HeadSchedule:
    """Each head's mean share of the capped global top-k over contexts (module docstring).

    Args:
        scores: per context ``[compressed_layers, kv_heads, n]`` float32 entry scores (KVzip's ``score``).
        ratio: keep ratio in (0, 1]; cap: ``max_head_ratio`` in (0, 1].

    Returns:
        ``HeadSchedule`` whose ``fractions`` sum to 1. Raises ``ValueError`` for no contexts or unequal shapes.
    """
    from .methods.budgets import capped_top_k

    if not scores or len({tuple(s.shape[:2]) for s in scores}) != 1:
        raise ValueError("schedule_from_scores: give at least one context, all of one model")
    shares = []
    for s in scores:
        keep = capped_top_k(s, int(round(ratio * s.numel())), cap)
        kept = keep.sum(dim=2).float()
        shares.append(kept / kept.sum().clamp_min(1))
    fractions = torch.stack(shares).mean(dim=0)
    return HeadSchedule(fractions, list(compressed_layers), fingerprint,
                        {"ratio": ratio, "max_head_ratio": cap, "contexts": len(scores), **(source or {})})


def save_schedule(schedule: HeadSchedule, path: str | os.PathLike, storage_options: dict | None = None) -> int:
    """Write ``schedule`` to ``path`` (a local path or an fsspec URL) as safetensors, atomically. Returns the bytes
    written. Raises ``InputError`` if the destination cannot be written."""
    from safetensors.torch import save

    metadata = {"format": SCHEDULE_FORMAT, "version": SCHEDULE_VERSION,
                "fingerprint": json.dumps(schedule.fingerprint, sort_keys=True),
                "compressed_layers": json.dumps(schedule.compressed_layers),
                "source": json.dumps(schedule.source, sort_keys=True)}
    tensors = {"fractions": schedule.fractions.detach().float().cpu().clone().contiguous()}
    return storage.write_atomic(path, save(tensors, metadata=metadata), storage_options)


def load_schedule(path: str | os.PathLike, storage_options: dict | None = None) -> HeadSchedule:
    """Read and validate a schedule written by ``save_schedule``.

    Raises:
        InputError: missing, larger than ``MAX_SCHEDULE_FILE_BYTES``, not safetensors, another format or version,
            a missing or malformed tensor or field (named), or fractions negative, non-finite or all zero.
    """
    where = f"schedule file {path}"
    meta, loaded = read_safetensors(path, storage_options, MAX_SCHEDULE_FILE_BYTES, where, _MAKE_IT)
    if meta.get("format") != SCHEDULE_FORMAT:
        raise InputError(f"{where} is not a kvpack head schedule (format {meta.get('format')!r}); {_MAKE_IT}")
    if meta.get("version") != SCHEDULE_VERSION:
        raise InputError(f"{where} has version {meta.get('version')!r}; this kvpack reads version "
                         f"{SCHEDULE_VERSION}")
    if set(loaded) != {"fractions"}:
        raise InputError(f"{where} must hold exactly the tensor fractions, found "
                         f"{', '.join(sorted(loaded)) or 'none'}")
    fp = _json_field(meta, "fingerprint", dict, where)
    layers = _json_field(meta, "compressed_layers", list, where)
    source = _json_field(meta, "source", dict, where)
    kv_heads = check_layers_field(fp, layers, where)
    t = loaded["fractions"]
    if t.dtype != torch.float32 or tuple(t.shape) != (len(layers), kv_heads):
        raise InputError(f"{where}: tensor fractions must be float32 of shape {[len(layers), kv_heads]}, got "
                         f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()) or not float(t.sum()) > 0:
        raise InputError(f"{where}: fractions must be finite, non-negative and not all zero")
    return HeadSchedule(t, layers, fp, source)


def check_schedule(schedule: HeadSchedule, model, tokenizer, *, path: str = "the schedule file") -> None:
    """Raise ``ModelMismatchError`` naming both models unless ``schedule`` was made for ``model`` (its fingerprint)
    and covers its compressed layers."""
    from .model import model_spec

    check_fingerprint(schedule.fingerprint, model_fingerprint(model, tokenizer), path=path,
                      fix=f"Use the schedule of the model given, or {_MAKE_IT}")
    layers = list(model_spec(model).compressed_layers)
    if schedule.compressed_layers != layers:
        raise ModelMismatchError(f"{path} covers layers {schedule.compressed_layers}, the model compresses "
                                 f"{layers}; {_MAKE_IT}")
