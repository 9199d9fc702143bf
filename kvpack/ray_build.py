"""``kvpack build --ray``: the same build spread over the GPUs (or CPUs) of a node or a Ray cluster, with Ray Data.

    plan = plan_build(discover_contexts(["s3://bucket/docs/"], storage_options=opts), "s3://bucket/packs",
                      BuildSettings.make(method="kvzip", ratio=0.3), model_id=model_identity(name),
                      storage_options=opts)
    for result in run_build_with_ray(plan, model_name=name, workers=8, gpus_per_worker=1):
        print(result.name, result.status, result.error)

The driver plans as a serial build does (``kvpack.build.plan_build``: names, the manifest, what is up to date,
without the model). The contexts that need the model become a Ray Dataset (one row per context: its index in
the plan and its fields); a callable-class stage (``_BuildStage``) loads the model once per actor and runs the
serial build's own ``run_build`` on each row's one-context plan, so the up-to-date check against the model,
``--split``, the failure reasons and the packs' bytes are those of a serial build. Each actor writes its packs to
``--out`` through ``kvpack.storage``; only the results and their manifest records come back, and the driver
writes the manifest and yields the results in the plan's order (``fail_fast`` stops there at the first failure;
actors may already have written later packs, which a re-run then finds by their headers).

Every worker must reach the model (a hub id, or a path present on every node) and ``--out`` (a URL such as
``s3://`` for a cluster; a local folder only works when every worker shares it, e.g. one node).
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Any, Iterator

from . import errors as _errors
from . import storage
from .build import BuildPlan, BuildResult, Context, _Item, item_needs_model, run_build
from .errors import InputError, KvpackError
from .manifest import FIELDS, ManifestWriter

__all__ = ["RAY_INSTALL", "run_build_with_ray"]

#: How to get Ray Data, named in the error ``--ray`` raises without it.
RAY_INSTALL = "pip install 'kvpack[ray]'"
_CONTEXT_FIELDS = tuple(f.name for f in fields(Context))  # what goes to an actor, as JSON
_RESULT_FIELDS = tuple(f.name for f in fields(BuildResult))  # what comes back


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise InputError(f"--ray needs Ray Data, which is not installed; install it with {RAY_INSTALL} "
                         "(or build without --ray)") from None
    return ray


class _Records:
    """A manifest stand-in for ``run_build``: keeps the records instead of writing them."""

    def __init__(self):
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append({k: record.get(k) for k in FIELDS})


def _one_item_plan(plan: BuildPlan, item: _Item) -> BuildPlan:
    return BuildPlan(plan.out, plan.settings, plan.model_id, plan.overwrite, [item], {}, plan.storage_options)


def _run_one(plan: BuildPlan, model, tokenizer, split: bool) -> str:
    """``run_build`` of a one-context plan: its results and records, as JSON (what goes back to the driver)."""
    records = _Records()
    results = list(run_build(plan, model, tokenizer, split=split, manifest=records))
    return json.dumps([[{k: str(getattr(r, k)) if k == "path" else getattr(r, k) for k in _RESULT_FIELDS}, rec]
                       for r, rec in zip(results, records.records)], ensure_ascii=False)


class _BuildStage:
    """The Ray Data stage: one instance per actor, holding one loaded model.

    ``__call__`` takes a batch of rows (``index``, ``plan``: the driver's plan without items, as JSON, and the
    context's fields) and returns ``index`` and ``outcome`` (``_run_one``'s JSON) per row, or ``fatal`` (the error
    class and message) when the actor could not load the model: the driver then raises it, as a serial build would.
    """

    def __init__(self, model_name: str | None, device: str, dtype: str, threads: int, plan: BuildPlan,
                 split: bool):
        import torch

        from .model import load_model

        if threads:
            torch.set_num_threads(threads)
        self.plan, self.split, self.fatal = plan, split, ""
        try:  # an actor that raises here would be restarted by Ray, again and again: report it instead
            self.model, self.tokenizer = load_model(model_name, device=device, dtype=dtype)
        except KvpackError as exc:
            self.fatal = json.dumps([type(exc).__name__, str(exc)])

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        out: dict[str, list] = {"index": [], "outcome": [], "fatal": []}
        for row in range(len(batch["index"])):
            fields = json.loads(str(batch["context"][row]))
            ctx = Context(**{**fields, "file": storage.as_path(fields["file"])})
            out["index"].append(int(batch["index"][row]))
            out["fatal"].append(self.fatal)
            outcome = ""
            if not self.fatal:
                item = _Item(ctx, storage.join(self.plan.out, ctx.pack))
                outcome = _run_one(_one_item_plan(self.plan, item), self.model, self.tokenizer, self.split)
            out["outcome"].append(outcome)
        return out


def run_build_with_ray(plan: BuildPlan, *, model_name: str | None, device: str = "auto", dtype: str = "auto",
                       split: bool = False, fail_fast: bool = False, workers: int | None = None,
                       gpus_per_worker: float = 0, address: str | None = None, threads: int = 0
                       ) -> Iterator[BuildResult]:
    """``kvpack.build.run_build`` with the contexts that need the model built by Ray Data actors.

    Args:
        plan: from ``plan_build`` (its ``storage_options`` reach every actor).
        model_name: what each actor loads with ``kvpack.load_model`` (``None``: the embedded reference model); it
            must be reachable from every node.
        device, dtype: as ``kvpack.load_model``, in each actor (with ``gpus_per_worker`` > 0 each actor sees its
            own GPU(s) and ``auto`` picks CUDA).
        split, fail_fast: as ``run_build``.
        workers: actors (model copies) [default: the cluster's GPUs / ``gpus_per_worker``, or 1 without GPUs].
        gpus_per_worker: GPUs Ray reserves for each actor (0: CPU actors, one CPU each).
        address: the Ray cluster to join (``ray://host:10001``, ``auto``); default: the running one, else a
            local one. A Ray already initialised in this process is used as it is.
        threads: torch CPU threads per actor (0: Ray's default for a one-CPU actor, i.e. 1).

    Yields:
        One ``BuildResult`` per context (per part when split), in the plan's order, as ``run_build``; the manifest
        gets the same records.

    Raises:
        InputError: Ray is not installed (the message says ``pip install 'kvpack[ray]'``); bad ``workers`` or
            ``gpus_per_worker``.
        KvpackError: an actor could not load the model (the serial build's error class and message).
    """
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise InputError(f"--workers must be a positive number of actors, got {workers!r}")
    if not isinstance(gpus_per_worker, (int, float)) or isinstance(gpus_per_worker, bool) or gpus_per_worker < 0:
        raise InputError(f"--gpus-per-worker must be >= 0, got {gpus_per_worker!r}")
    ray = _import_ray()
    todo = [i for i, item in enumerate(plan.items) if item_needs_model(item)]
    outcomes: dict[int, list] = {}
    if todo:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        if workers is None:
            gpus = ray.cluster_resources().get("GPU", 0)
            workers = max(1, int(gpus // gpus_per_worker)) if gpus_per_worker else 1
        rows = [{"index": i, "context": json.dumps({k: str(getattr(plan.items[i].ctx, k)) if k == "file" else
                                                    getattr(plan.items[i].ctx, k) for k in _CONTEXT_FIELDS},
                                                   ensure_ascii=False)} for i in todo]
        shell = BuildPlan(plan.out if storage.is_url(plan.out) else os.path.abspath(plan.out), plan.settings,
                          plan.model_id, plan.overwrite, [], {}, plan.storage_options)
        ds = ray.data.from_items(rows, override_num_blocks=min(len(rows), 4 * workers))
        stage = ds.map_batches(
            _BuildStage, batch_size=1, concurrency=workers, num_gpus=gpus_per_worker or None,
            num_cpus=None if gpus_per_worker else 1,
            fn_constructor_kwargs=dict(model_name=model_name, device=device, dtype=dtype, threads=threads,
                                       plan=shell, split=split))
        for row in stage.take_all():
            if row["fatal"]:
                kind, message = json.loads(row["fatal"])
                cls = getattr(_errors, kind, KvpackError)
                raise (cls if isinstance(cls, type) and issubclass(cls, KvpackError) else KvpackError)(message)
            outcomes[int(row["index"])] = json.loads(row["outcome"])
    with ManifestWriter(plan.out, plan.records, storage_options=plan.storage_options) as manifest:
        for i, item in enumerate(plan.items):
            if i in outcomes:
                pairs = [(BuildResult(**{**r, "path": storage.as_path(r["path"])}), rec) for r, rec in outcomes[i]]
            else:  # up to date, unreadable or known to fail: no model needed, as in the serial build
                records = _Records()
                results = list(run_build(_one_item_plan(plan, item), split=split, manifest=records))
                pairs = list(zip(results, records.records))
            for result, record in pairs:
                manifest.write(record)
                yield result
                if fail_fast and result.status == "failed":
                    return
