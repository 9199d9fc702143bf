"""Attention Matching's on-policy queries in one sweep (arXiv 2602.16284 §3.3).

On-policy, layer ``l`` is fitted on the queries its reference passes (KVzip's repeat chunks, the self-study answers,
the sampled continuations) produce once the compressed layers before ``l`` are compacted. Computed layer by layer
(``am_policy``), that is one forward call per pass *and* layer: about ``L / 2`` full passes on an ``L``-layer model.
Yet the queries of layer ``l`` depend only on layers ``< l``, so every pass can run once, all of them in step:
each pass runs in its own thread through the model's own forward; at each compressed layer its attention call hands
over the layer's queries (``PackedLayer.queries``) and waits; when every pass has arrived the calling thread fits
the layer on the pooled queries, and each pass then attends to the layer's compacted entries (the context range it
sees, biases included, plus its own new tokens) and goes on to the next layer. The result is the layer-by-layer
replay's (``tests/test_am.py`` checks it against ``am_policy``), for one forward call per pass.

Threads, not a hand-written layer loop: the model's own forward runs unchanged (its masks, RoPE, per-layer-type
attention), whatever the architecture; only one kvpack attention call per pass and layer waits. Queries are pooled
in pass order, never arrival order, so the fit is deterministic.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..cache import KvpackCache, PackedLayer
from ..pack import LayerEntries
from ..prefill import Prefill
from .am_policy import compacted_chunk_layer
from .kvzip import RepeatPassDone, stop_after_attention

__all__ = ["PolicyPass", "on_policy_sweep"]


@dataclass
class PolicyPass:
    """One reference pass of the sweep: ``input_ids`` (token ids) fed after the context into ``cache`` (a
    ``Prefill.view_cache``), which holds the sink plus context tokens ``[start, stop)`` (after the sink) of every
    full-attention layer."""

    cache: KvpackCache
    input_ids: list[int]
    start: int
    stop: int


class _Sweep:
    """The state the pass threads and the fitting thread share: one ``threading.Barrier`` for all of them, the
    queries each pass handed over at the current layer, and the compacted layers each pass attends to next."""

    def __init__(self, passes: int):
        self.barrier = threading.Barrier(passes + 1)
        self.handed: list[tuple[torch.Tensor, float] | None] = [None] * passes
        self.compacted: list[PackedLayer | None] = [None] * passes
        self.errors: list[BaseException] = []


class _Gate:
    """Set as ``PackedLayer.queries`` of one pass's view of one compressed layer: the attention function's
    ``append`` hands the queries over, waits for the layer's fit and returns the compacted layer to attend to
    (``kvpack.attention.kvpack_attention_forward`` attends to a layer returned so)."""

    def __init__(self, sweep: _Sweep, index: int, view: PackedLayer):
        self.sweep, self.index, self.view = sweep, index, view

    def append(self, item: tuple[torch.Tensor, float]) -> PackedLayer:
        sweep = self.sweep
        sweep.handed[self.index] = item
        sweep.barrier.wait()  # every pass has handed over this layer's queries
        sweep.barrier.wait()  # the layer is fitted and compacted
        layer = sweep.compacted[self.index]
        layer.keys, layer.values = self.view.keys, self.view.values  # this pass's own new tokens
        return layer


def on_policy_sweep(model, prefill: Prefill, layers: list[LayerEntries], passes: list[PolicyPass],
                    fit_layer: Callable[[int, list[tuple[torch.Tensor, float]]], None]) -> None:
    """Run ``passes`` once each, in step, fitting every compressed layer on the passes' own queries of it.

    For compressed layer ``i`` (``prefill.spec.compressed_layers[i]``), in order, ``fit_layer(i, handed)`` is called
    in this thread with ``handed``, one ``(query [heads, q, head_dim], scaling)`` per pass in ``passes``' order
    (after q-norm and RoPE), computed with the compressed layers before ``i`` holding their compacted ``layers``
    entries; it must compact ``layers[prefill.spec.compressed_layers[i]]`` in place (values and ``biases``). Each
    pass then attends to that layer's compacted entries of its context range (``am_policy.compacted_chunk_layer``)
    and goes on; every pass ends after the attention of the last compressed layer.

    Raises whatever a pass's forward or ``fit_layer`` raises (the other passes are stopped, the threads joined);
    ``RuntimeError`` if a pass ends without reaching every compressed layer (a model whose attention does not go
    through kvpack's attention function).
    """
    compressed = list(prefill.spec.compressed_layers)
    if not passes or not compressed:
        return
    device = prefill.keys[0].device
    sweep = _Sweep(len(passes))
    for p, one in enumerate(passes):
        for l in compressed:
            one.cache.layers[l].queries = _Gate(sweep, p, one.cache.layers[l])

    def run(p: int, one: PolicyPass) -> None:
        done = False
        try:
            with torch.inference_mode():
                model.base_model(input_ids=torch.tensor([one.input_ids], device=device), past_key_values=one.cache,
                                 use_cache=True)
        except RepeatPassDone:
            done = True  # the last compressed layer has attended (stop_after_attention's hook, set below)
        except threading.BrokenBarrierError:
            pass  # another pass or the fit failed; its error is reported
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread, which raises it
            sweep.errors.append(exc)
        finally:
            # a pass that ends early must not leave the others waiting; one that is done must not abort: the fitting
            # thread may not have woken from the last barrier yet, and an abort then breaks its wait
            if not done:
                sweep.barrier.abort()

    threads = [threading.Thread(target=run, args=(p, one), daemon=True) for p, one in enumerate(passes)]
    with stop_after_attention(model.base_model, compressed[-1]):  # one hook, shared by the passes' threads
        _drive(threads, sweep, prefill, layers, passes, fit_layer)


def _drive(threads, sweep: _Sweep, prefill: Prefill, layers: list[LayerEntries], passes: list[PolicyPass],
           fit_layer) -> None:
    """Start the passes' ``threads`` and fit the compressed layers as the passes reach them (``on_policy_sweep``)."""
    sink, device = prefill.sink, prefill.keys[0].device
    for t in threads:
        t.start()
    try:
        for i, l in enumerate(prefill.spec.compressed_layers):
            sweep.barrier.wait()
            fit_layer(i, list(sweep.handed))
            sweep.compacted = [compacted_chunk_layer(layers[l], sink, sink + one.start, sink + one.stop,
                                                     prefill.tokens, device) for one in passes]
            sweep.barrier.wait()
    except threading.BrokenBarrierError:
        for t in threads:
            t.join()
        if sweep.errors:
            raise sweep.errors[0]
        raise RuntimeError("am: an on-policy pass ended before reaching every compressed layer; the model's "
                           "attention must run through kvpack's attention function") from None
    except BaseException:
        sweep.barrier.abort()
        for t in threads:
            t.join()
        raise
    for t in threads:
        t.join()
    if sweep.errors:
        raise sweep.errors[0]
