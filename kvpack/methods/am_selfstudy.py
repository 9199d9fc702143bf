"""Attention Matching's self-study reference queries (arXiv 2602.16284 §4.1, "self-study"; the official code's
``compaction/query_generation/self_study.py`` with ``conversation_specs.py``): the model answers a few prompts about
the cached context, and the queries of the prompt and answer tokens are recorded.

Each prompt of ``PROMPTS`` (the official specs' conversation starters ``summarize``, ``aggregate`` and
``structure_json``, and the ``3_question`` seed prompt) is laid out as a question after the context
(``ChatLayout.question_ids``) and answered for at most ``tokens`` tokens (stopping at end-of-sequence), over the
full prefilled cache, ``samples`` times per prompt. With ``temperature = 0`` (this function's default) the answers
are greedy, one per prompt. With ``temperature > 0`` (``--method am``'s default: 0.7, two answers per prompt) they
are sampled as the official code samples its self-study answers without thinking
(``SelfStudyConfig``: temperature 0.7, top-k 20, top-p 0.8), through transformers' logits warpers, each answer
from its own ``torch.Generator`` seeded by ``(seed, answer index)``: two builds with one seed record the same
queries, and the batch draws the same tokens as one prompt at a time. The paper generates up to 2,048 answer
tokens per prompt (4,096 with thinking for its questions); kvpack bounds the cost to ``tokens`` forward calls per
prompt (the prompt, then ``tokens - 1`` answer tokens).

The prompts are answered as one batch (``_batched``) when the model has no sliding-window layers: the context's
KV held once (``kvpack.shared_context``: each decode step attends every row's queries over the shared context in one
fused call, plus each row's own short suffix). The prompts are fed first packed in one row, each seeing only the
context and its own tokens (``kvpack.shared_context.unpack_rows``: no padding computed), then answered as a
left-padded batch, so a decode step reads the weights once for all prompts and copies no context. On SmolLM2 at 2K
tokens, 64 calls x 4 prompts, the batch (before the packing) took 18.9 s against 34.8 s one prompt at a time (0.54x;
``tools/bench_selfstudy.py``, BENCHMARKS.md); the packing then took 16 calls from 2.84 s to 2.47 s. Otherwise one at a
time over the prefill's own cache (``_one_by_one``). Both record the queries of the same tokens
(``tests/test_am_budgets.py``).
"""

from __future__ import annotations

import torch

from ..attention import masks_unused, queries_to, use_kvpack_attention
from ..prefill import Prefill
from ..shared_context import shared_context_cache, unpack_rows
from .am_continue import recording_cache

__all__ = ["PROMPTS", "TOP_K", "TOP_P", "self_study_queries"]

#: The paper code's self-study prompts (``conversation_specs.py``: summarize, aggregate, structure_json,
#: 3_question).
PROMPTS = (
    "Summarize the main points of the context.",
    "Aggregate all the key facts mentioned in the context.",
    "Structure the information in JSON form and include all important details like dates, times, names, and "
    "numerical values.",
    "Write 3 questions that test understanding of different parts of the context. Answer with just the 3 questions "
    "and options (do not say the correct answer), each one separated with 2 newlines.",
)

#: The official code's sampling of self-study answers without thinking (``SelfStudyConfig``'s note), used with
#: ``temperature > 0`` (the paper's temperature is 0.7).
TOP_K, TOP_P = 20, 0.8


class _NextToken:
    """Each row's next token from its logits: the argmax, or with ``temperature > 0`` a draw from the warped
    distribution (temperature, then top-k ``TOP_K``, then top-p ``TOP_P``, transformers' order) with prompt
    ``i``'s own generator, seeded ``seed * 1,000,003 + i``."""

    def __init__(self, prompts: int, temperature: float, seed: int):
        self.warpers = None
        if temperature > 0:
            from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                                TopKLogitsWarper, TopPLogitsWarper)

            self.warpers = LogitsProcessorList([TemperatureLogitsWarper(float(temperature)),
                                                TopKLogitsWarper(TOP_K), TopPLogitsWarper(TOP_P)])
            self.generators = [torch.Generator().manual_seed(int(seed) * 1_000_003 + i) for i in range(prompts)]

    def __call__(self, logits: torch.Tensor, prompt_ids: list[int]) -> torch.Tensor:
        """``logits`` ``[rows, vocab]``, row ``r`` answering prompt ``prompt_ids[r]`` -> ``[rows]`` int64 token
        ids (on the logits' device)."""
        logits = logits.float()
        if self.warpers is None:
            return logits.argmax(dim=-1)
        probs = torch.softmax(self.warpers(None, logits), dim=-1).cpu()
        drawn = [torch.multinomial(probs[r], 1, generator=self.generators[i]) for r, i in enumerate(prompt_ids)]
        return torch.cat(drawn).to(logits.device)


@torch.inference_mode()
def self_study_queries(model, tokenizer, prefill: Prefill, reservoirs: list, tokens: int,
                       prompts: tuple[str, ...] = PROMPTS, batched_off: bool = False, fed: list | None = None,
                       temperature: float = 0.0, seed: int = 0, samples: int = 1) -> list:
    """Answer each prompt ``samples`` times for at most ``tokens`` tokens after the context (greedily, or sampled:
    module docstring) and add each compressed layer's queries (each prompt's tokens once, every answer's tokens) to
    its reservoir.

    Args:
        model: the causal LM whose ``prefill`` this is; tokenizer: its tokenizer.
        prefill: the full prefill (``kvpack.prefill``); nothing in it is changed.
        reservoirs: one ``QueryReservoir`` per compressed layer, in ``prefill.spec.compressed_layers`` order.
        tokens: answer tokens per prompt at most, ``>= 1``.
        prompts: the prompts (default ``PROMPTS``).
        batched_off: answer one prompt at a time even where the batch would apply (tests compare the two).
        fed: if given, each prompt's token ids as fed after the context (prompt, then the answer tokens fed) are
            appended to it as a list of ints, for replaying them (``am_policy.replayed_queries``).
        temperature: ``0`` (default) answers greedily; ``> 0`` samples at that temperature with top-k ``TOP_K`` and
            top-p ``TOP_P`` (the paper's: 0.7).
        seed: the sampled answers' seed, ``>= 0`` (unused when greedy).
        samples: answers per prompt, ``>= 1`` (more than one only makes sense sampled). Answer ``c`` of prompt
            ``p`` draws from generator ``c x len(prompts) + p``, so ``samples=1`` draws as before. The prompt is
            computed and recorded once for all its answers (batched: its packed slots are copied into each answer's
            row); ``fed`` gets one sequence per answer, prompt included.

    Returns:
        ``reservoirs``, filled. Raises nothing of its own.
    """
    choose = _NextToken(len(prompts) * samples, temperature, seed)
    if not prefill.spec.sliding_layers and not batched_off:
        return _batched(model, tokenizer, prefill, reservoirs, tokens, prompts, fed, choose, samples)
    return _one_by_one(model, tokenizer, prefill, reservoirs, tokens, prompts, fed, choose, samples)


def _room(model, prefill: Prefill, prompt_tokens: int, tokens: int) -> int:
    """Forward calls left for one prompt of ``prompt_tokens`` tokens: ``tokens``, fewer where the model's positions
    run out (``<= 0``: none)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return tokens if limit is None else min(tokens, int(limit) - prefill.tokens - prompt_tokens)


def _one_by_one(model, tokenizer, prefill: Prefill, reservoirs: list, tokens: int, prompts, fed: list | None,
                choose: _NextToken, samples: int = 1) -> list:
    cache, device = recording_cache(model, prefill, reservoirs)
    compressed = [cache.layers[l] for l in prefill.spec.compressed_layers]
    eos = tokenizer.eos_token_id
    for copy in range(samples):
        for index, prompt in enumerate(prompts):
            cache.rewind()
            ids = prefill.layout.question_ids(tokenizer, prompt)
            room = _room(model, prefill, len(ids), tokens)
            if room < 0:
                break  # the context leaves no positions for this prompt
            x = torch.tensor([ids], device=device)
            sequence = []
            for step in range(room):
                sequence.extend(x[0].tolist())
                muted = copy > 0 and step == 0  # the prompt's queries are recorded with its first answer only
                if muted:
                    for layer in compressed:
                        layer.queries = None
                logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1]
                if muted:
                    for layer, reservoir in zip(compressed, reservoirs):
                        layer.queries = reservoir
                nxt = int(choose(logits[None], [copy * len(prompts) + index])[0])
                if eos is not None and nxt == eos:
                    break
                x = torch.tensor([[nxt]], device=device)
            if fed is not None and sequence:
                fed.append(sequence)
    cache.rewind()
    return reservoirs


def _batched(model, tokenizer, prefill: Prefill, reservoirs: list, tokens: int, prompts, fed: list | None,
             choose: _NextToken, samples: int = 1) -> list:
    """The prompts as one batch continuing the context held once (module docstring), one row per answer (``samples``
    per prompt, answer-major); the same tokens' queries as ``_one_by_one`` (a row stops at its end-of-sequence token,
    which is not fed, or after ``room`` calls)."""
    use_kvpack_attention(model)
    device = prefill.keys[0].device
    eos = tokenizer.eos_token_id
    ids = [prefill.layout.question_ids(tokenizer, p) for p in prompts]
    kept = []
    for index, x in enumerate(ids):  # as _one_by_one: stop at the first prompt with no positions left; a room of
        room = _room(model, prefill, len(x), tokens)  # 0 records nothing
        if room < 0:
            break
        if room > 0:
            kept.append((x, room, index))
    if not kept:
        return reservoirs
    # the prompts are packed and computed once; the batch has one row per answer, row r answering packed prompt
    # source[r] with generator indices[r] (answer c of prompt p: c x len(prompts) + p)
    packed_ids = [x for x, _, _ in kept]
    source = [k for _ in range(samples) for k in range(len(kept))]
    ids = [packed_ids[k] for k in source]
    rooms = [kept[k][1] for k in source]
    indices = [c * len(prompts) + kept[k][2] for c in range(samples) for k in range(len(kept))]
    batch, width, n = len(ids), max(len(x) for x in ids), prefill.tokens
    lengths = [len(x) for x in packed_ids]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    valid = torch.zeros(batch, width, dtype=torch.bool, device=device)
    for b, r in enumerate(ids):
        valid[b, width - len(r):] = True
    # every slot after the prompts is real (a row that stopped feeds padding nobody reads, as it attends alone)
    slots_valid = torch.cat([valid, torch.ones(batch, max(rooms) - 1, dtype=torch.bool, device=device)], dim=1)
    # the prompts go in first packed one after another in one row (no padding computed: on SmolLM2 the four
    # prompts are 115 tokens, 192 padded), each seeing the context and its own tokens; the answers are then
    # decoded as a left-padded batch of one row per answer (unpack_rows)
    segments = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                       torch.tensor(lengths, device=device))
    packed = shared_context_cache(prefill.keys, prefill.values, torch.ones(1, sum(lengths), dtype=torch.bool,
                                                                           device=device), segments[None])
    slots = {l: reservoirs[i] for i, l in enumerate(prefill.spec.compressed_layers)}
    state = {"valid": None}

    def sink(layer_idx, query, scaling):
        reservoir = slots.get(layer_idx)
        if reservoir is None:
            return
        if state["valid"] is None:  # the packed prompts: one row, prompt b's tokens in order
            start = 0
            for length in lengths:
                reservoir.append((query[0][:, start : start + length].detach(), scaling))
                start += length
            return
        for b in range(batch):
            if bool(state["valid"][b].any()):
                reservoir.append((query[b][:, state["valid"][b]].detach(), scaling))

    active = torch.ones(batch, dtype=torch.bool, device=device)
    calls = torch.tensor(rooms, device=device)
    sequences = [list(r) for r in ids]  # what each row feeds: its prompt, then its answer tokens while active
    with queries_to(sink), masks_unused():
        x = torch.tensor([[t for r in packed_ids for t in r]], device=device)
        positions = torch.cat([torch.arange(n, n + len(r), device=device) for r in packed_ids])[None]
        last = torch.tensor(lengths, device=device).cumsum(0) - 1  # each prompt's last token in the packed row
        logits = model(input_ids=x, position_ids=positions, past_key_values=packed, use_cache=True,
                       logits_to_keep=last).logits[0][torch.tensor(source, device=device)]
        cache = unpack_rows(packed, lengths, slots_valid, rows=source)
        positions = torch.tensor([[n + len(r) - 1] for r in ids], device=device)
        for step in range(max(rooms)):
            if step:
                for b in range(batch):
                    if bool(state["valid"][b, 0]):
                        sequences[b].append(int(x[b, 0]))
                logits = model(input_ids=x, position_ids=positions, past_key_values=cache, use_cache=True,
                               logits_to_keep=1).logits[:, -1]
            nxt = choose(logits, indices)
            active &= step + 1 < calls  # row b makes rooms[b] calls at most
            if eos is not None:
                active &= nxt != eos
            if not bool(active.any()):
                break
            x = torch.where(active, nxt, torch.full_like(nxt, pad))[:, None]
            state["valid"] = active[:, None]
            positions = positions + 1
    if fed is not None:
        fed.extend(sequences)
    return reservoirs
