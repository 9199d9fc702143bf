"""Run NVIDIA kvpress presses on contexts and questions exported by ``kvpack bench`` (the peer's side).

This script runs INSIDE the kvpress virtual environment (``.venv-kvpress/``, made by ``tools/peer_kvpress.py``),
which pins an older transformers than kvpack; so it imports neither kvpack nor anything kvpack-specific. It reads
one JSON job file and writes one JSON results file::

    python kvpress_worker.py JOB.json RESULTS.json

Job (written by ``kvpack.bench.peer.export_job``)::

    {"model": "/abs/model/folder", "max_new_tokens": 32, "threads": 1, "baseline": true,
     "presses": ["kvzip", "snapkv", "streaming"], "ratios": [0.5, 0.3],      # ratios = fraction KEPT
     "items": [{"task": "needle", "key": "...", "context_ids": [...], "questions_ids": [[...], ...]}, ...]}

``context_ids`` are kvpack's own cached sequence (chat-template prefix + context) and ``questions_ids`` kvpack's
question tokens (blank line, question, end of turn, assistant header), so both libraries see identical tokens. A
continuation item (``"task": "continuation"``) has ``target_ids`` instead of ``questions_ids``: after the prefill,
``target_ids[:-1]`` are teacher-forced from the same cache (explicit positions after the context, as the pipeline
feeds a question) and ``target_ids[1:]`` scored. With ``"baseline": true`` every item is also run once without any press
(press ``"none"``, ratio 1.0): kvpress's plain path, which must answer as kvpack's full-cache reference does.
Each (item, press, ratio) is run the way kvpress's ``KVPressTextGenerationPipeline._forward`` runs it: the context
is prefilled with ``model.model`` inside ``with press(model):`` (kvpress's ``compression_ratio`` is the fraction
REMOVED, so it is ``1 - ratio``), then every question is answered in turn from the same cache with the pipeline's
own ``generate_answer`` (greedy, explicit positions after the context) and the answer is removed from the cache
with the pipeline's ``_remove_answer_from_cache``. Nothing is written to disk: kvpress keeps no file, and its
KVzip press masks evicted keys during decoding instead of removing them (memory is not reduced).

Results::

    {"versions": {...}, "rows": [{"task", "key", "press", "ratio", "answers": [...], "compress_s": float,
      "answer_s": [...], "kv_entries": int, "kv_entries_full": int}, ...]}

A continuation row has ``nll`` (mean negative log-likelihood of ``target_ids[1:]``, nats/token), ``kl`` (mean
KL(no press || press) of the next-token distributions, nats) and ``top1_agreement`` (share of positions whose
argmax matches the run without a press) instead of ``answers``/``answer_s``; ``kl`` and ``top1_agreement`` are
``None`` without ``"baseline": true`` (the run without a press comes first and is the reference).

``kv_entries``: (layer, KV head, position) entries the press left visible; ``kv_entries_full``: the same for the
uncompressed cache. Errors: a press that raises is recorded as ``{"error": "..."}`` in its row, so one failing
press does not lose the others.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback


def _press(name: str, kept: float):
    """The kvpress press ``name`` keeping the fraction ``kept`` of the KV entries (default press parameters)."""
    import kvpress

    removed = max(0.0, 1.0 - float(kept))
    if name == "kvzip":
        return kvpress.KVzipPress(compression_ratio=removed)
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=removed)
    if name == "streaming":
        return kvpress.StreamingLLMPress(compression_ratio=removed)
    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=removed)
    if name == "random":
        return kvpress.RandomPress(compression_ratio=removed)
    raise ValueError(f"unknown press {name!r}; choose kvzip, snapkv, streaming, knorm or random")


def _visible_entries(model, cache) -> int:
    """Entries the cache holds minus those kvpress masks (``masked_key_indices``), over layers and KV heads."""
    total = 0
    for layer_idx, layer in enumerate(cache.layers):
        total += int(layer.keys.shape[1] * layer.keys.shape[2])
        masked = getattr(model.model.layers[layer_idx].self_attn, "masked_key_indices", None)
        if masked is not None:
            total -= int(masked[0].numel())
    return total


def _teacher_forced(model, cache, target_ids: list[int], context_length: int):
    """``[len(target_ids) - 1, vocab]`` float32 log-probabilities of feeding ``target_ids[:-1]`` after the
    context through ``cache`` at positions ``context_length ..`` (row ``i``: the distribution of
    ``target_ids[i + 1]``)."""
    import torch

    x = torch.tensor([target_ids[:-1]], dtype=torch.long)
    position_ids = torch.arange(context_length, context_length + x.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        logits = model(input_ids=x, past_key_values=cache, position_ids=position_ids).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _continuation_scores(logprobs, target_ids: list[int], reference) -> dict:
    """``{"nll", "kl", "top1_agreement"}`` of ``logprobs`` (``_teacher_forced``) for ``target_ids[1:]``, KL and
    agreement against ``reference`` (the run without a press; ``None``: both ``None``)."""
    import torch

    target = torch.tensor(target_ids[1:], dtype=torch.long)
    out = {"nll": float(-logprobs.gather(1, target[:, None]).mean()), "kl": None, "top1_agreement": None}
    if reference is not None:
        out["kl"] = float((reference.exp() * (reference - logprobs)).sum(-1).mean())
        out["top1_agreement"] = float((reference.argmax(-1) == logprobs.argmax(-1)).float().mean())
    return out


def run(job: dict) -> dict:
    """Run every (item, press, ratio) of ``job``; returns the results dict described in the module docstring."""
    import logging

    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    torch.set_num_threads(int(job.get("threads", 1)))
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("kvpress").setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=model.device)
    rows = []
    for item in job["items"]:
        ctx = torch.tensor([item["context_ids"]], dtype=torch.long)
        full_entries = model.config.num_hidden_layers * model.config.num_key_value_heads * ctx.shape[1]
        runs = [("none", 1.0)] if job.get("baseline") else []
        runs += [(name, kept) for name in job["presses"] for kept in job["ratios"]]
        reference = None  # the run without a press's log-probabilities (continuation items)
        for name, kept in runs:
            row = {"task": item["task"], "key": item["key"], "press": name, "ratio": float(kept),
                   "kv_entries_full": int(full_entries)}
            try:
                press = _press(name, kept) if name != "none" else None
                cache = DynamicCache()
                t0 = time.perf_counter()
                with torch.inference_mode(), (press(model) if press is not None else contextlib.nullcontext()):
                    model.model(input_ids=ctx, past_key_values=cache)
                row["compress_s"] = time.perf_counter() - t0
                row["kv_entries"] = _visible_entries(model, cache)
                if "target_ids" in item:  # continuation: teacher-forced, scored against the run without a press
                    logprobs = _teacher_forced(model, cache, item["target_ids"], ctx.shape[1])
                    if name == "none":
                        reference = logprobs
                    row.update(_continuation_scores(logprobs, item["target_ids"],
                                                    reference if job.get("baseline") else None))
                else:
                    answers, times = [], []
                    with torch.inference_mode():
                        for q in item["questions_ids"]:
                            lengths = [cache.get_seq_length(i) for i in range(len(cache))]
                            t0 = time.perf_counter()
                            answers.append(pipe.generate_answer(
                                question_ids=torch.tensor([q], dtype=torch.long), cache=cache,
                                context_length=ctx.shape[1], max_new_tokens=int(job["max_new_tokens"])))
                            times.append(time.perf_counter() - t0)
                            pipe._remove_answer_from_cache(cache, lengths)
                    row["answers"], row["answer_s"] = answers, times
            except Exception as exc:  # noqa: BLE001 - one failing press must not lose the others
                row["error"] = f"{type(exc).__name__}: {exc}"
                row["traceback"] = traceback.format_exc(limit=4)
            finally:
                for layer in model.model.layers:  # a masking press leaves indices on the modules
                    layer.self_attn.masked_key_indices = None
            rows.append(row)
            print(f"kvpress {name} keep {kept} {item['key']}: "
                  + (row.get("error") or f"{row['compress_s']:.2f} s"), file=sys.stderr, flush=True)
    versions = {"kvpress": getattr(kvpress, "__version__", None), "transformers": transformers.__version__,
                "torch": torch.__version__}
    try:
        from importlib.metadata import version

        versions["kvpress"] = version("kvpress")
    except Exception:  # noqa: BLE001
        pass
    return {"versions": versions, "rows": rows}


def main(argv: list[str]) -> int:
    """``kvpress_worker.py JOB.json RESULTS.json``; exit status 0, or 2 on bad usage."""
    if len(argv) != 2:
        print("usage: kvpress_worker.py JOB.json RESULTS.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        job = json.load(f)
    out = run(job)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
