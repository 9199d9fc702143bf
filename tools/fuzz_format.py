#!/usr/bin/env python
"""Adversarial campaign against the ``.kvpack`` reader: mutated files must give only typed errors (``KvpackError``),
``verify`` and ``load_pack`` must agree, none may take longer than ``--max-seconds`` or grow the worker past
``--max-rss-mb``.

Each file is derived from a seed (the golden files of ``format/golden/`` and a few generated packs: zstd, int4,
int8, biases) by one of these mutation classes, chosen at random with a per-file seed (``--seed`` + index, so a run
is reproducible and resumable):

* raw damage (checksums left as they are): ``flip`` (1-8 bits), ``overwrite`` (random bytes), ``truncate``,
  ``insert``/``delete`` (random bytes), ``splice`` (a range of another seed), ``length`` (the header length prefix);
* re-signed hostile edits (all offsets, tensor checksums and the header SHA-256 recomputed per the spec with
  ``tests/forge.py``, so the reader's own checks are what fire): ``json_type`` (a random node of the header
  replaced by a value of another type: lists where strings are expected, huge integers, long strings, deep
  nesting), ``meta_type`` (the same inside the ``kvpack``, ``quant``, ``tensor_codecs`` texts), ``meta_field``
  (fields that load/info/generate read: fingerprint, layout, layer_kinds, ratio, sink_tokens, ...), ``shape``
  (dims, ranks, dtypes of a tensor, with data resized to match), ``content`` (tensor elements set to extremes,
  NaN, infinities, shuffled), ``counts`` (layers / KV heads / entries declared huge in a few bytes through zstd
  frames of zeros), ``frame`` (zstd frame bytes damaged, re-signed), ``nesting`` (deeply nested JSON anywhere),
  ``bloat`` (long strings, many keys, many tensors). The two expensive classes, ``nesting`` and ``bloat``, are
  drawn a quarter as often as the others.

Every file goes through ``read_header``, ``verify``, ``load_pack`` and ``load_pack_placed`` (``kvpack.load``'s
reader, decoding straight to float32: it must accept exactly the files ``load_pack`` accepts, with the same values
bit for bit and the same range verdict); a file that loads is then range-checked as ``kvpack.load`` does, laid
out as a ``KvpackCache`` and written back if it passes, none of which may fail with an untyped error; one that
fails the range check must be refused by the writer too, with ``InputError``. Progress goes to ``--out``/log.txt
every ``--log-every`` files; the state (counts, slowest case, peak RSS) to ``--out``/state.json, from which a rerun
resumes; files that broke a rule are kept under ``--out``/failures/ with the traceback.

    nohup python tools/fuzz_format.py --files 100000 --workers 2 --out runs/fuzz > runs/fuzz.nohup 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import resource
import struct
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

from kvpack.errors import InputError, KvpackError  # noqa: E402
from kvpack.fileformat import load_pack, load_pack_placed, pack_to_bytes, read_header, verify  # noqa: E402
from tests.forge import canon, restore, split  # noqa: E402

RAW = ("flip", "overwrite", "truncate", "insert", "delete", "splice", "length")
SIGNED = ("json_type", "meta_type", "meta_field", "shape", "content", "counts", "frame", "nesting", "bloat")
CLASSES = RAW + SIGNED
#: Relative frequency of each class: the expensive-to-build ones (megabyte headers) are drawn less often.
WEIGHTS = {c: (1 if c in ("nesting", "bloat") else 4) for c in CLASSES}


def seeds() -> dict[str, bytes]:
    """The seed files: every golden file plus generated packs (bigger, zstd, quantized, with biases)."""
    from tests.golden_packs import GOLDEN_DIR
    from kvpack.pack import LayerEntries, Pack
    from kvpack.quant import quantize_pack

    out = {p.name: p.read_bytes() for p in sorted(GOLDEN_DIR.glob("*.kvpack"))}
    g = torch.Generator().manual_seed(0)
    layers = []
    for lengths in ([40, 7, 0, 33], [2, 50, 35, 1], [36, 36, 36, 36]):
        pos = [torch.randperm(64, generator=g)[:n].sort().values for n in lengths]
        n = sum(lengths)
        layers.append(LayerEntries(torch.randn(n, 16, generator=g).half(), torch.randn(n, 16, generator=g).half(),
                                   torch.cat(pos).int(), torch.tensor(lengths), biases=torch.rand(n, generator=g) - 0.5))
    layout = {"prefix": "<s>", "separator": "\n\n", "turn_end": "\nA:", "templated": False}
    meta = {"method": "kvzip", "ratio": 0.5, "layout": layout, "layer_kinds": ["compressed"] * 3,
            "fingerprint": {"name": "toy", "num_layers": 3, "rope": {"theta": 1e4}, "sliding_layers": []},
            "stats": {"layer_budgets": [1, 2, 3]}, "source": {"name": "x", "sha256": "0" * 64}}
    pack = Pack(torch.arange(64), layers, 2, meta)
    out["gen_f16_biases_zstd"] = pack_to_bytes(pack, 3)
    out["gen_int4_biases"] = pack_to_bytes(quantize_pack(pack, "int4", 32))
    out["gen_int8_zstd_sha256"] = pack_to_bytes(quantize_pack(pack, "int8", 32), 5, "sha256")
    return out


# --- mutations --------------------------------------------------------------------------------------------------


def _value(rng: random.Random, depth: int = 0):
    """A random JSON value, hostile more often than not."""
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice([0, 1, -1, 2**31, 2**31 - 1, 2**63, -(2**63), 10**400 // 10**300, 7])
    if kind == 1:
        return rng.choice([0.5, -0.0, 1e308, 1e-320, 3.0])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.choice(["", "F32", "I32", "U8", "zstd", "int4", "none", "compact", "1.0", "x" * rng.randrange(1, 5000)])
    if kind == 4:
        return "é\u0000\ud800" * rng.randrange(1, 40)
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))] if depth < 3 else []
    if kind == 6:
        return {rng.choice(["dtype", "shape", "a", "", "prefix"]): _value(rng, depth + 1)} if depth < 3 else {}
    if kind == 7:
        d = rng.choice([20, 33, 64, 1000, 50_000])
        return json.loads("[" * min(d, 900) + "]" * min(d, 900)) if d < 900 else [0]
    if kind == 8:
        return [rng.randrange(-2, 2**31) for _ in range(rng.randrange(1, 6))]
    if kind == 9:
        return [1] * rng.choice([5, 100, 20_000])
    if kind == 10:
        return {str(i): i for i in range(rng.choice([2, 100, 5000]))}
    return rng.randrange(-10, 10**6)


def _nodes(obj, path=()):
    """Every (path, value) of a JSON object, depth first."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _nodes(v, path + (i,))


def _set(obj, path, value):
    if not path:
        return value
    node = obj
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return obj


def _tensors(obj: dict) -> list[str]:
    return [n for n in obj if n != "__metadata__"]


def _json_text_edit(rng: random.Random, obj: dict) -> None:
    """Edit one of the JSON texts inside ``__metadata__`` (type confusion at a random node)."""
    meta = obj["__metadata__"]
    key = rng.choice([k for k in ("kvpack", "quant", "tensor_codecs") if k in meta])
    inner = json.loads(meta[key])
    path, _ = rng.choice(list(_nodes(inner)))
    inner = _set(inner, path, _value(rng))
    meta[key] = json.dumps(inner, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


_FIELDS = {
    "sink_tokens": lambda r: r.choice([-1, 0, 10**6, "2", None, 2.0, [2]]),
    "fingerprint": lambda r: r.choice([[], "x", {"rope": [1]}, {"sliding_layers": "ab"}, {"name": 7},
                                       {"name": "n" * 2000}, None, {"num_layers": "many"}]),
    "layout": lambda r: r.choice(["chat", [], {"prefix": 1}, {"prefix": "", "separator": "", "turn_end": "",
                                                              "templated": "yes"},
                                  {"prefix": "p" * 70000, "separator": "", "turn_end": "", "templated": True}]),
    "layer_kinds": lambda r: r.choice([[], ["compressed"] * 9, "compressed", [1, 2], ["other"] * 3]),
    "ratio": lambda r: r.choice(["0.5", -1, 0, 2, None, [0.5], True]),
    "method": lambda r: r.choice([1, None, ["kvzip"], "m" * 5000]),
    "method_params": lambda r: r.choice([[], "x", 3]),
    "source": lambda r: r.choice([[], "x", {"name": 5}, {"sha256": ["a"]}]),
    "stats": lambda r: r.choice([[], {"layer_budgets": "x"}, {"layer_budgets": ["a"]}, {"quant_error": [1, "x"]},
                                 {"merge": {"merged": "a"}}]),
    "kvpack_version": lambda r: r.choice([1, None, {"v": 1}]),
}


def _resized(rng: random.Random, obj: dict, buf_parts: dict[str, bytes]) -> dict[str, bytes]:
    """Change one tensor's dtype or shape and give it random bytes of the new size (the container stays valid)."""
    name = rng.choice(_tensors(obj))
    entry = obj[name]
    codecs = json.loads(obj["__metadata__"].get("tensor_codecs", "{}"))
    target = codecs.get(name, entry)
    shape = list(target["shape"])
    op = rng.randrange(5)
    if op == 0 and shape:
        shape[rng.randrange(len(shape))] = rng.choice([0, 1, 2, 3, 5, 7, 31, 64, 4096])
    elif op == 1:
        shape = shape + [rng.choice([1, 2, 3])]
    elif op == 2 and shape:
        shape = shape[:-1]
    elif op == 3:
        target["dtype"] = rng.choice(["F32", "F16", "BF16", "I32", "I64", "U8"])
    else:
        shape = [rng.choice([0, 1, 2, 3, 4, 12, 124, 2**20]) for _ in shape]
    target["shape"] = shape
    itemsize = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "U8": 1}.get(target["dtype"], 1)
    n = int(np.prod(shape)) * itemsize if shape else itemsize
    if name in codecs:
        codecs[name]["raw_bytes"] = n
        raw = bytes(min(n, 1 << 24))
        buf_parts[name] = zstandard.ZstdCompressor(level=1).compress(raw) if n <= 1 << 24 else b"\x28\xb5\x2f\xfd"
        obj["__metadata__"]["tensor_codecs"] = canon(codecs).decode()
    elif n <= 1 << 20:
        entry["shape"] = shape
        buf_parts[name] = rng.randbytes(n)
    return buf_parts


def _content(rng: random.Random, obj: dict, data: bytes) -> dict[str, bytes]:
    """Overwrite some elements of one raw tensor with extremes (the file keeps its sizes)."""
    raw = [n for n in _tensors(obj) if n not in json.loads(obj["__metadata__"].get("tensor_codecs", "{}"))]
    if not raw:
        return {}
    name = rng.choice(raw)
    from tests.forge import stored

    b = bytearray(stored(data, name))
    code = obj[name]["dtype"]
    size = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "U8": 1}[code]
    if len(b) < size:
        return {}
    values = {4: [struct.pack("<i", v) for v in (-1, 0, 2**31 - 1, -(2**31), 1, 7)]
              + [struct.pack("<f", v) for v in (float("nan"), float("inf"), -float("inf"), 1e30, -31.0)],
              2: [b"\x00\x7c", b"\x00\xfc", b"\x01\x7e", b"\xff\xff", b"\x00\x00"],
              1: [bytes([v]) for v in (0, 1, 8, 9, 255)], 8: [bytes(8)]}[size]
    if rng.random() < 0.2:  # shuffle the elements
        items = [bytes(b[i : i + size]) for i in range(0, len(b) - size + 1, size)]
        rng.shuffle(items)
        return {name: b"".join(items) + bytes(b[len(items) * size :])}
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(len(b) // size) * size
        b[i : i + size] = rng.choice(values)
    return {name: bytes(b)}


def mutate(rng: random.Random, cls: str, data: bytes, other: bytes) -> bytes:
    """One mutated file of class ``cls`` from seed ``data`` (``other``: a second seed, for splicing)."""
    if cls == "flip":
        b = bytearray(data)
        for _ in range(rng.randrange(1, 9)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if cls == "overwrite":
        b = bytearray(data)
        i = rng.randrange(len(b))
        n = rng.randrange(1, 64)
        b[i : i + n] = rng.randbytes(n)
        return bytes(b)
    if cls == "truncate":
        return data[: rng.randrange(len(data))]
    if cls == "insert":
        i = rng.randrange(len(data) + 1)
        return data[:i] + rng.randbytes(rng.randrange(1, 32)) + data[i:]
    if cls == "delete":
        i = rng.randrange(len(data))
        return data[:i] + data[i + rng.randrange(1, 32) :]
    if cls == "splice":
        i, j = rng.randrange(len(data)), rng.randrange(len(other))
        return data[:i] + other[j : j + rng.randrange(1, 512)] + data[i + rng.randrange(0, 512) :]
    if cls == "length":
        n = rng.choice([0, 7, 8, 35, 2**32, 2**63, 2**64 - 1, int.from_bytes(data[:8], "little") + rng.randrange(-16, 17)])
        return max(0, n).to_bytes(8, "little") + data[8:]

    obj, _ = split(data)
    blobs: dict[str, bytes] = {}
    edit = None
    if cls == "json_type":
        path, _ = rng.choice([p for p in _nodes(obj) if p[0]])

        def edit(o, path=path, value=_value(rng)):
            _set(o, path, value)
    elif cls == "meta_type":
        def edit(o):
            _json_text_edit(rng, o)
    elif cls == "meta_field":
        key = rng.choice(list(_FIELDS))

        def edit(o, key=key, value=_FIELDS[key](rng)):
            kv = json.loads(o["__metadata__"]["kvpack"])
            kv[key] = value
            o["__metadata__"]["kvpack"] = canon(kv).decode()
    elif cls == "shape":
        blobs = _resized(rng, obj, blobs)
        new = obj

        def edit(o, new=new):
            o.clear()
            o.update(new)
    elif cls == "content":
        blobs = _content(rng, obj, data)
    elif cls == "counts":
        codecs = json.loads(obj["__metadata__"].get("tensor_codecs", "{}"))
        name = rng.choice(["head_lengths", "positions", "token_ids", "keys"])
        shape = {"head_lengths": [rng.choice([1, 5000, 2**20]), rng.choice([2, 100_000, 2**21])],
                 "positions": [rng.choice([2**24, 2**26])], "token_ids": [rng.choice([2**24, 2**28])],
                 "keys": [rng.choice([2**20, 2**24]), 16]}[name]
        dtype = "F16" if name == "keys" else "I32"
        raw = int(np.prod(shape)) * (2 if dtype == "F16" else 4)
        frame = (b"\x28\xb5\x2f\xfd" + bytes([0xC0, 0x00]) + raw.to_bytes(8, "little") + b"\x01\x00\x00")
        if name in codecs or rng.random() < 0.5:
            codecs[name] = {"codec": "zstd", "dtype": dtype, "filter": "none", "level": 1, "raw_bytes": raw,
                            "shape": shape}
            blobs[name] = frame

            def edit(o, name=name, codecs=codecs):
                o[name]["dtype"] = "U8"
                o[name]["shape"] = [len(frame)]
                o["__metadata__"]["tensor_codecs"] = canon(codecs).decode()
        else:
            def edit(o, name=name, shape=shape):
                o[name]["shape"] = shape
    elif cls == "frame":
        codecs = json.loads(obj["__metadata__"].get("tensor_codecs", "{}"))
        if not codecs:
            return mutate(rng, "content", data, other)
        from tests.forge import stored

        name = rng.choice(sorted(codecs))
        b = bytearray(stored(data, name))
        for _ in range(rng.randrange(1, 4)):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        if rng.random() < 0.3:
            b = b[: rng.randrange(len(b) + 1)] if rng.random() < 0.5 else b + rng.randbytes(rng.randrange(1, 9))
        blobs[name] = bytes(b)
    elif cls == "nesting":
        depth = rng.choice([33, 100, 10_000, 200_000])
        where = rng.randrange(3)

        def edit(o, depth=depth, where=where):
            if where == 0:  # inside the kvpack text
                o["__metadata__"]["kvpack"] = o["__metadata__"]["kvpack"][:-1] + ',"zz":' + "[" * depth + "]" * depth + "}"
            elif where == 1:
                o["__metadata__"]["quant"] = "[" * depth + "]" * depth
            else:
                o["__metadata__"]["tensor_codecs"] = '{"keys":' + "{" * 1 + '"a":' * 0 + "[" * depth + "]" * depth + "}}"
    else:  # bloat
        kind = rng.randrange(3)

        def edit(o, kind=kind):
            if kind == 0:
                kv = json.loads(o["__metadata__"]["kvpack"])
                kv["pad"] = "p" * rng.choice([10_000, 500_000, 1_045_000, 5_000_000])
                o["__metadata__"]["kvpack"] = canon(kv).decode()
            elif kind == 1:
                for i in range(rng.choice([70, 1000, 20_000])):
                    o["__metadata__"][f"x{i}"] = ""
            else:
                o["keys"]["shape"] = o["keys"]["shape"] + [1] * rng.choice([3, 1000, 500_000])
    try:
        return restore(data, blobs, edit)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError, RecursionError):
        return mutate(rng, rng.choice(RAW), data, other)  # the edit did not apply to this seed


# --- checking ---------------------------------------------------------------------------------------------------


def check(data: bytes) -> tuple[str, float, str | None]:
    """Run every reader on ``data``: ``(outcome, slowest seconds, problem or None)``. Outcome: the error class name
    or ``"ok"``; a problem is an untyped exception, a disagreement between readers, or a loaded pack that cannot be
    used."""
    results, slowest = {}, 0.0
    pack = None
    for name, reader in (("read_header", read_header), ("verify", verify), ("load_pack", load_pack)):
        t0 = time.perf_counter()
        try:
            out = reader(data)
            results[name] = "ok"
            if name == "load_pack":
                pack = out
        except KvpackError as exc:
            results[name] = type(exc).__name__
        except BaseException as exc:  # noqa: BLE001 - the campaign reports every untyped error
            slowest = max(slowest, time.perf_counter() - t0)
            return "untyped", slowest, f"{name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        slowest = max(slowest, time.perf_counter() - t0)
    if results["verify"] != results["load_pack"]:
        return "disagree", slowest, f"verify says {results['verify']}, load_pack {results['load_pack']}"
    if results["read_header"] != "ok" and results["load_pack"] == "ok":
        return "disagree", slowest, f"read_header says {results['read_header']} but load_pack loads it"
    t0 = time.perf_counter()
    try:
        placed = load_pack_placed(data, dtype=torch.float32)  # kvpack.load's reader: decoded straight to float32
    except KvpackError as exc:
        placed = type(exc).__name__
    except BaseException as exc:  # noqa: BLE001
        return "untyped", slowest, f"load_pack_placed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    slowest = max(slowest, time.perf_counter() - t0)
    if isinstance(placed, str) != (pack is None):
        return "disagree", slowest, f"load_pack says {results['load_pack']}, load_pack_placed " \
                                    f"{placed if isinstance(placed, str) else 'ok'}"
    if pack is not None:
        problem = _placed_problem(pack, *placed[1:])
        if problem is not None:
            return "disagree", slowest, problem
    if pack is not None:
        t0 = time.perf_counter()
        try:
            from kvpack.cache import KvpackCache
            from kvpack.loading import check_kv_range

            try:
                check_kv_range(pack)  # as kvpack.load: KV out of range is refused before the layout
            except KvpackError:
                try:
                    pack_to_bytes(pack)
                except InputError:
                    pass  # the writer refuses what the loader refuses
                else:
                    return "disagree", slowest, "the writer accepts KV that kvpack.load refuses"
            else:
                KvpackCache.from_pack(pack, dtype=torch.float32)
                pack_to_bytes(pack)
        except BaseException as exc:  # noqa: BLE001
            return "unusable", slowest, f"a loaded pack fails downstream: {type(exc).__name__}: {exc}\n" \
                                        f"{traceback.format_exc()}"
        slowest = max(slowest, time.perf_counter() - t0)
    return results["load_pack"], slowest, None


def _placed_problem(pack, placed, ranges) -> str | None:
    """How ``load_pack_placed``'s pack differs from ``load_pack``'s cast to float32 (bit for bit, but every NaN is
    one NaN: casts may keep or quiet a payload), or whether the two range checks disagree; None if they agree."""
    from kvpack.validate import kv_range_problem

    def bits(t):
        t = t.detach().float()
        return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).contiguous().view(torch.int32)

    if not torch.equal(pack.token_ids, placed.token_ids):
        return "load_pack_placed: other token ids"
    for l, (a, b) in enumerate(zip(pack.layers, placed.layers, strict=True)):
        same = (torch.equal(bits(a.keys), bits(b.keys)) and torch.equal(bits(a.values), bits(b.values))
                and torch.equal(a.positions.long(), b.positions) and torch.equal(a.head_lengths, b.head_lengths)
                and (a.biases is None) == (b.biases is None)
                and (a.biases is None or torch.equal(bits(a.biases), bits(b.biases))))
        if not same:
            return f"load_pack_placed: layer {l} differs from load_pack's"
    if (kv_range_problem(pack) is None) != (kv_range_problem(placed, ranges) is None):
        return "load_pack_placed: its range check disagrees with load_pack's"
    return None


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(args, start: int, stop: int, queue) -> None:
    seed_files = seeds()
    names = sorted(seed_files)
    out = Path(args.out)
    counts: dict[str, dict[str, int]] = {}
    slowest = (0.0, None, None)
    done = 0
    for i in range(start, stop):
        rng = random.Random(args.seed * 1_000_003 + i)
        cls = CLASSES[i % len(CLASSES)] if args.round_robin else rng.choices(CLASSES, [WEIGHTS[c] for c in CLASSES])[0]
        seed_name = rng.choice(names)
        data = mutate(rng, cls, seed_files[seed_name], seed_files[rng.choice(names)])
        outcome, seconds, problem = check(data)
        counts.setdefault(cls, {}).setdefault(outcome, 0)
        counts[cls][outcome] += 1
        if seconds > slowest[0]:
            slowest = (seconds, i, f"{cls} of {seed_name} -> {outcome}, {len(data)} bytes")
        if problem is not None or seconds > args.max_seconds:
            (out / "failures").mkdir(parents=True, exist_ok=True)
            (out / "failures" / f"{i}.kvpack").write_bytes(data)
            (out / "failures" / f"{i}.txt").write_text(f"{cls} of {seed_name}: {outcome}, {seconds:.3f} s\n"
                                                       f"{problem or 'too slow'}\n")
        done += 1
        if done % args.log_every == 0 or i == stop - 1:
            queue.put(("progress", start, i + 1, counts, slowest, _rss_mb()))
            counts = {}
    queue.put(("done", start, stop, {}, slowest, _rss_mb()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000, help="mutated files in all")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/fuzz")
    ap.add_argument("--log-every", type=int, default=2000)
    ap.add_argument("--max-seconds", type=float, default=5.0, help="a file slower than this is a failure")
    ap.add_argument("--max-rss-mb", type=float, default=1024.0, help="a worker peak RSS above this fails the run")
    ap.add_argument("--round-robin", action="store_true", help="cycle through the classes instead of drawing them")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    if state.get("seed", args.seed) != args.seed:
        raise SystemExit(f"{state_path} is a run with another --seed; use another --out")
    per = -(-args.files // args.workers)
    chunks = [(w * per, min(args.files, (w + 1) * per)) for w in range(args.workers)]
    progress = {str(a): state.get("progress", {}).get(str(a), a) for a, _ in chunks}
    counts = state.get("counts", {})
    slowest = state.get("slowest", [0.0, None, None])
    peak = state.get("peak_rss_mb", 0.0)
    log = open(out / "log.txt", "a")
    started = time.time()
    print(f"{time.strftime('%H:%M:%S')} start: {args.files} files, {args.workers} workers, seed {args.seed}, "
          f"resuming at {progress}", file=log, flush=True)
    queue = mp.get_context("spawn").Queue()
    procs = []
    for a, b in chunks:
        if progress[str(a)] < b:
            p = mp.get_context("spawn").Process(target=worker, args=(args, progress[str(a)], b, queue))
            p.start()
            procs.append(p)
    running = len(procs)
    while running:
        kind, a, upto, c, slow, rss = queue.get()
        key = next(str(x) for x, y in chunks if x <= a < y or (a == y and x < y))
        if kind == "done":
            running -= 1
        else:
            progress[key] = upto
        for cls, outcomes in c.items():
            for outcome, n in outcomes.items():
                counts.setdefault(cls, {}).setdefault(outcome, 0)
                counts[cls][outcome] += n
        if slow[0] > slowest[0]:
            slowest = list(slow)
        peak = max(peak, rss)
        total = sum(n for o in counts.values() for n in o.values())
        bad = sum(n for o in counts.values() for k, n in o.items() if k in ("untyped", "disagree", "unusable"))
        state = {"seed": args.seed, "files": args.files, "progress": progress, "counts": counts, "slowest": slowest,
                 "peak_rss_mb": peak, "total": total, "problems": bad}
        tmp = state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(tmp, state_path)
        print(f"{time.strftime('%H:%M:%S')} {total} files, {bad} problems, slowest {slowest[0]:.3f} s, peak RSS "
              f"{peak:.0f} MB, {time.time() - started:.0f} s this run", file=log, flush=True)
    for p in procs:
        p.join()
    total = sum(n for o in counts.values() for n in o.values())
    bad = sum(n for o in counts.values() for k, n in o.items() if k in ("untyped", "disagree", "unusable"))
    summary = (f"done: {total} files, {bad} problems, slowest {slowest[0]:.3f} s ({slowest[2]}), peak RSS "
               f"{peak:.0f} MB (limit {args.max_rss_mb:.0f})")
    print(summary, file=log, flush=True)
    print(summary)
    print(json.dumps(counts, indent=1, sort_keys=True))
    sys.exit(1 if bad or slowest[0] > args.max_seconds or peak > args.max_rss_mb else 0)


if __name__ == "__main__":
    main()
