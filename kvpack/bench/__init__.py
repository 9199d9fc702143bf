"""``kvpack bench``: fidelity, speed and size of every compression method side by side, with kvpress beside them.

Tasks (one module each), all on held-out text (``kvpack/data/haystack``) with the same contexts and seeds for
every method:

* ``needle``: one fact planted at depths 0-100 % in contexts of 1K/2K/4K tokens; exact match (RULER,
  arXiv 2404.06654; KVzip, arXiv 2505.23416).
* ``multiquery``: several facts in one context, compressed once, saved, loaded once, every fact asked in turn
  (the KVzip setting); query-aware SnapKV (arXiv 2404.14469) given the first question is scored too.
* ``continuation``: teacher-forced NLL of the document's real next 256 tokens, ΔNLL/token and KL vs the full cache.
* ``speed``: build vs prefill, load vs re-prefill, decode step, file bytes per token; peak build memory per length
  in fresh processes (``memory``).
* ``peer``: NVIDIA kvpress in its own virtual environment on the same token ids (``kvpress_worker``).

``grid`` builds every ratio x quant of a method from one prefill (byte-identical to ``kvpack.compress``);
``report`` writes JSON, Markdown and PNGs; ``runner`` ties it together::

    from kvpack.bench import BenchConfig, run_bench
    run_bench(BenchConfig.quick(), "bench-out/")
"""

from .runner import TASKS, BenchConfig, estimate_seconds, run_bench

__all__ = ["BenchConfig", "run_bench", "estimate_seconds", "TASKS"]
