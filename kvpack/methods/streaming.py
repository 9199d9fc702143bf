"""StreamingLLM: attention sinks plus the most recent tokens (Xiao et al., arXiv 2309.17453, §3.2, Fig. 1d)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from ..prefill import Prefill
from .base import Method
from .params import StreamingLLMParams

__all__ = ["StreamingLLM"]


@dataclass
class StreamingLLM(StreamingLLMParams, Method):
    """Keep the first ``sink`` context tokens and the most recent ones, the same positions in every head.

    Score of context token ``j`` (0 = first token after the chat-template prefix): ``+inf`` for ``j < sink``,
    else ``j``, so each head's budget holds the sinks and then the latest ``budget - sink`` tokens. The
    template prefix is kvpack's own attention sink and is always kept on top; ``sink`` counts tokens from the
    start of the context. The budget is split evenly over layers and KV heads (scope ``head``, fixed).

    Parameters (declared in ``kvpack.methods.params``):
        sink: attention-sink tokens kept at the start of the context (paper: 4, §3.2).
    """

    fixed_scope: ClassVar[str] = "head"

    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        spec = prefill.spec
        scores = torch.arange(prefill.context_tokens, dtype=torch.float32)
        scores[: self.sink] = float("inf")
        return scores.expand(len(spec.compressed_layers), spec.num_kv_heads, -1).clone()
