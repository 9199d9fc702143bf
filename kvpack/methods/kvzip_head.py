"""KVzip's context-independent mode: whole KV heads kept or dropped by head scores found once per model (Kim et
al., arXiv 2505.23416, §3.3; the official code's ``--level head``). No scoring pass: the build is one prefill."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import storage
from ..errors import InputError
from ..heads import check_head_scores, load_head_scores, top_heads
from ..prefill import Prefill
from .base import Method
from .params import KVzipHeadParams

__all__ = ["KVzipHead"]


@dataclass
class KVzipHead(KVzipHeadParams, Method):
    """Keep every context entry of the top ``ratio`` of (compressed layer, KV head) pairs by head score, and only
    the attention sink (plus, with ``window``, the last ``window`` context tokens) in the others.

    The head scores come from a file made once per model by ``kvpack heads`` (``kvpack.heads``: the max of each
    head's KVzip entry scores, maximised over a few contexts). ``ratio`` here is the fraction of (layer, KV head)
    pairs kept, as in the paper (its recommended 0.6); the fraction of context entries kept is the same without a
    window and ``ratio + (1 - ratio) x window / tokens`` with one (the pack's ``stats.context_entries_kept``
    records it). Pairs are ranked by score, ties to the earlier layer, then the lower head. Dropped heads hold
    zero context entries in the file (only the sink, which every head keeps). The official code keeps the
    system prompt and later queries in dropped heads (README, "Context-independent eviction"); kvpack's sink is
    the chat-template prefix and questions are appended at load time, so the behaviour is the same.

    Parameters (declared in ``kvpack.methods.params``):
        heads: path of the head-score file (safetensors; ``kvpack heads ... --out heads.safetensors``); required.
            Checked against the model (fingerprint) before use.
        window: recent context tokens also kept in dropped heads (default 0: the paper's sink only).
    """

    _scores: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        if self.heads is None:
            raise InputError("kvzip-head needs head scores: make them once per model with `kvpack heads DOC.txt "
                             "... --model M --out heads.safetensors` (API: kvpack.head_scores + "
                             "kvpack.save_head_scores), then pass --heads heads.safetensors (API: heads=PATH)")
        self._scores = load_head_scores(self.heads)
        self._sha256 = hashlib.sha256(storage.read_bytes(self.heads)).hexdigest()  # a path or a URL

    def params(self) -> dict:
        """``heads`` (the path given), ``heads_sha256`` (of the file's bytes) and ``window``."""
        return {"heads": self.heads, "heads_sha256": self._sha256, "window": self.window}

    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        """Each head's score repeated over its context positions: ``[compressed_layers, kv_heads,
        context_tokens]`` float32. Raises ``ModelMismatchError`` if the file was made for another model."""
        check_head_scores(self._scores, model, tokenizer, path=f"head-score file {self.heads}")
        s = self._scores.scores.to(prefill.keys[0].device)
        return s[:, :, None].expand(-1, -1, prefill.context_tokens).contiguous()

    def select(self, scores: torch.Tensor, ratio: float, prefill: Prefill | None = None) -> torch.Tensor:
        """Keep mask ``[layers, kv_heads, tokens]`` bool: all tokens of the top ``round(ratio x layers x kv_heads)``
        heads by score, the last ``window`` tokens of the others."""
        scores = scores.detach().float().cpu()
        layers, heads, n = scores.shape
        kept = top_heads(scores.amax(dim=-1) if n else torch.zeros(layers, heads), ratio)
        keep = kept[:, :, None].expand(layers, heads, n).clone()
        if self.window:
            keep[:, :, max(0, n - self.window):] = True
        return keep
