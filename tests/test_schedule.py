"""Issue 28: influence-based head schedules (``kvpack.schedule_solver``, ``kvpack schedule``): the greedy solver on
hand-made gains, the evicted cache's continuation loss against an independent masked reference, and the command
on the embedded reference model, its file checked, refused for another model, and read by an AM build."""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import kvpack
from kvpack import tasks
from kvpack.cli import cli
from kvpack.errors import InputError, ModelMismatchError
from kvpack.schedule import check_schedule, load_schedule
from kvpack.schedule_solver import (_continuation_nll, _evicted_layer, _scored_contexts, greedy_allocation,
                                    influence_schedule)

from .reference import masked_reference_logits
from .tiny import tiny_model


@functools.lru_cache(maxsize=None)
def _reference():
    return kvpack.load_model(None)


def _texts() -> list[str]:
    """Two short held-out passages (about 150 tokens each on the reference tokenizer)."""
    return [d[:600] for d in tasks.haystack_documents()[:2]]


# ---------------------------------------------------------------------------------------------------------------
# the greedy solver


def test_greedy_allocation_on_a_hand_made_table():
    # 4 heads, ratio 0.25, cap 0.5: one unit = 1/4 of the uniform share, 16 units in all; floor 1 unit, cap 8 units.
    down = torch.tensor([[5.0, 1.0], [3.0, 2.0]])
    up = torch.tensor([[4.0, 0.5], [1.0, 0.1]])
    got = greedy_allocation(down, up, 0.25, 0.5, floor=0.25, resolution=4)
    # head 0: 3 units at 5 to its share, 4 at 4 up to the cap; head 2: 3 at 3; head 3: the last 2 at 2; head 1 idle
    assert got.tolist() == [[8 / 16, 1 / 16], [4 / 16, 3 / 16]]
    # ties go to the lower index; a ratio above the cap raises the cap to the uniform share
    assert greedy_allocation(torch.ones(1, 4), torch.ones(1, 4), 0.25, 0.5, floor=0, resolution=4).tolist() == [
        [0.5, 0.5, 0.0, 0.0]]
    assert greedy_allocation(torch.ones(1, 2), torch.ones(1, 2), 0.8, 0.5, floor=0, resolution=4).tolist() == [
        [0.5, 0.5]]
    with pytest.raises(ValueError):
        greedy_allocation(down, up[:1], 0.25)


def _unit_by_unit(down, up, ratio, cap, floor, resolution):
    """The greedy one unit at a time, as the docstring states it."""
    d, u = down.flatten().tolist(), up.flatten().tolist()
    low = int(floor * resolution + 1e-9)
    high = max(int(cap / ratio * resolution + 1e-9), resolution)
    units = [low] * len(d)
    for _ in range(len(d) * resolution - low * len(d)):
        gains = [(d[h] if units[h] < resolution else u[h]) if units[h] < high else float("-inf")
                 for h in range(len(d))]
        h = max(range(len(d)), key=lambda i: (gains[i], -i))
        units[h] += 1
    return torch.tensor(units, dtype=torch.float64).div(len(d) * resolution).float().view(down.shape)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_allocation_is_the_unit_by_unit_greedy(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    shape = (rng.randint(1, 4), rng.randint(1, 3))
    down, up = torch.randn(shape, generator=g), torch.randn(shape, generator=g)  # concave or not
    down[0, 0] = up.flatten()[-1]  # a tie
    ratio, cap, floor = rng.choice([0.05, 0.1, 0.3]), rng.choice([0.2, 0.75, 1.0]), rng.choice([0.0, 0.25, 0.5])
    got = greedy_allocation(down, up, ratio, cap, floor=floor, resolution=20)
    assert torch.equal(got, _unit_by_unit(down, up, ratio, cap, floor, 20))
    assert abs(float(got.double().sum()) - 1) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# the loss over an evicted cache


def test_evicted_cache_loss_matches_a_masked_full_cache():
    model, tok = _reference()
    [(name, text, full, scores, target)] = list(_scored_contexts(model, tok, _texts()[:1], None, 64, 16))
    n, sink = full.context_tokens, full.sink
    order = torch.sort(scores, dim=2, descending=True, stable=True).indices
    cache = full.view_cache()
    budgets = [[3, n // 2], [0, 7], [n, 1], [n // 5, n // 3]]  # whole, empty and uneven heads
    kept = []
    for i, l in enumerate(full.spec.compressed_layers):
        cache.layers[l] = _evicted_layer(full, l, order[i], budgets[i])
        kept.append([set(range(sink)) | {sink + int(j) for j in order[i, h, : budgets[i][h]]}
                     for h in range(full.spec.num_kv_heads)])
    got = _continuation_nll(model, cache, target)
    ref = masked_reference_logits(model, full.token_ids.tolist(), target[:-1], kept, [None] * 4)
    want = float(-F.log_softmax(ref, -1).gather(1, torch.tensor(target[1:])[:, None]).mean())
    assert abs(got - want) < 1e-4
    assert _continuation_nll(model, cache, target) == got  # the cache is rewound


# ---------------------------------------------------------------------------------------------------------------
# the command


def test_schedule_command_writes_a_checked_influence_schedule_that_am_builds_with(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, t in enumerate(_texts()):
        (docs / f"d{i}.txt").write_text(t, encoding="utf-8")
    out = tmp_path / "schedule.safetensors"
    run = CliRunner().invoke(cli, ["schedule", str(docs), "--out", str(out), "--ratio", "0.2",
                                   "--continuation-tokens", "16", "--chunk-size", "64", "--threads", "1"])
    assert run.exit_code == 0, run.output
    sched = load_schedule(out)
    model, tok = _reference()
    check_schedule(sched, model, tok)
    other, otok = tiny_model("llama")
    with pytest.raises(ModelMismatchError):
        check_schedule(sched, other, otok)
    f = sched.fractions
    heads = f.numel()
    assert abs(float(f.double().sum()) - 1) < 1e-6
    assert float(f.max()) * 0.2 * heads <= 0.75 + 1e-6  # no head above the cap (as its keep ratio)
    assert float(f.min()) >= 0.25 / heads - 1e-6  # the floor
    assert float(f.max() - f.min()) > 0.01  # not uniform
    src = sched.source
    assert src["method"] == "influence" and "eviction" in src["proxy"] and src["ratio"] == 0.2
    assert src["max_head_ratio"] == 0.75 and src["delta"] == 0.5 and len(src["contexts"]) == 2
    assert src["evaluations"] == 2 * (2 * heads + 2) and src["tokens"] == sum(c["tokens"] for c in src["contexts"])
    assert "2602.16284" in src["reference"]
    # deterministic: the API gives the same fractions
    again, inf = influence_schedule(model, tok, [(docs / f"d{i}.txt").read_text() for i in range(2)], ratio=0.2,
                                    continuation_tokens=16, chunk_size=64)
    assert torch.equal(again.fractions, f) and inf.gain_down.shape == (2, 4, 2)
    # AM builds with it from the command line, and the pack loads
    packs = tmp_path / "packs"
    run = CliRunner().invoke(cli, ["build", str(docs / "d0.txt"), "--method", "am", "--ratio", "0.2", "--budgets",
                                   "schedule", "--schedule", str(out), "--out", str(packs), "--chunk-size", "64"])
    assert run.exit_code == 0, run.output
    pack = packs / "d0.kvpack"
    cache = kvpack.load(pack, model)
    assert cache.metadata["method_params"]["budgets"] == "schedule"
    assert len(cache.metadata["method_params"]["schedule_sha256"]) == 64


def test_schedule_command_scores_solver_and_errors(tmp_path):
    doc = tmp_path / "a.txt"
    doc.write_text(_texts()[0], encoding="utf-8")
    out = tmp_path / "new" / "s.safetensors"  # --out's folder is made
    run = CliRunner().invoke(cli, ["schedule", str(doc), "--out", str(out), "--solver", "scores", "--chunk-size",
                                   "64"])
    assert run.exit_code == 0, run.output
    sched = load_schedule(out)
    assert sched.source["method"] == "scores" and sched.source["contexts"][0]["name"] == "a"
    # a context too short for the held-back continuation: an error naming the fix, no traceback
    run = CliRunner().invoke(cli, ["schedule", str(doc), "--out", str(out), "--continuation-tokens", "5000"])
    assert run.exit_code == 1 and "--continuation-tokens" in run.output and "Traceback" not in run.output
    model, tok = _reference()
    with pytest.raises(InputError, match="delta"):
        influence_schedule(model, tok, [_texts()[0]], delta=0)
    with pytest.raises(InputError, match="ratio"):
        influence_schedule(model, tok, [_texts()[0]], ratio=1.0)
    with pytest.raises(InputError, match="one or more"):
        influence_schedule(model, tok, [])
