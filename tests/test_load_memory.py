"""Loading within what a pack honestly holds (issue 30): ``kvpack.load`` decodes each tensor once into its final
dtype and place (``fileformat.load_pack_placed``), checks its memory budget from the header before decoding, and
``kvpack info`` reads the header and the index tensors only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import kvpack
from kvpack import constants as C
from kvpack.cli import cli
from kvpack.codecs import encode, iter_decoded, writer_filter
from kvpack.errors import ChecksumMismatchError, CorruptFileError, InputError, MemoryBudgetError
from kvpack.fileformat import load_pack, read_header, read_index, read_index_arrays
from kvpack.loading import cache_from_pack, load_bytes, parse_size
from kvpack.pack import LayerEntries, Pack

from .forge import restore, stored
from .tiny import TEXT, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _cast(pack: Pack, dtype: torch.dtype) -> Pack:
    layers = [LayerEntries(e.keys.to(dtype), e.values.to(dtype), e.positions, e.head_lengths, e.quant, e.biases)
              for e in pack.layers]
    return Pack(token_ids=pack.token_ids, layers=layers, sink_tokens=pack.sink_tokens, metadata=pack.metadata)


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_model("llama")
    with torch.inference_mode():
        packs = {q: kvpack.compress(model, tok, TEXT, ratio=0.9, quant=q) for q in ("none", "int4")}
    return model, tok, packs


@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zstd_level", [0, 3])
def test_load_equals_the_cache_built_from_the_pack(tiny, tmp_path, quant, kv_dtype, zstd_level):
    """Decoding straight into the model's dtype (chunk by chunk, one stream reader per byte plane for zstd) gives
    the very cache the pack gives once read and cast."""
    model, tok, packs = tiny
    path = tmp_path / "p.kvpack"
    kvpack.save(_cast(packs[quant], kv_dtype), path, zstd_level=zstd_level)
    got = kvpack.load(path, model, tokenizer=tok)
    want = cache_from_pack(load_pack(path), model, tok)
    assert torch.equal(got.token_ids, want.token_ids)
    for a, b in zip(got.layers, want.layers, strict=True):
        assert a.kept_keys.dtype == model.dtype and a.kept_positions.dtype == torch.int64
        for name in ("kept_keys", "kept_values", "kept_positions"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.head_lengths == b.head_lengths


@pytest.mark.parametrize("code", ["F16", "BF16", "F32", "I32", "U8"])
@pytest.mark.parametrize("chunk", [1, 5, 4096, 10**9])
def test_iter_decoded_gives_the_raw_bytes_in_element_order(code, chunk):
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, 3 * 1031 * 4, dtype=np.uint8)[: 1031 * C.DTYPE_BY_CODE[code].itemsize].tobytes()
    itemsize = C.DTYPE_BY_CODE[code].itemsize
    for name in ("positions", "values"):
        filt = writer_filter(name, code)
        blob = encode(raw, code, filt, 3)
        out = b"".join(c.tobytes() for _, c in iter_decoded(lambda o, n: blob[o : o + n], len(blob), len(raw), filt,
                                                           itemsize, chunk))
        assert out == raw, (name, filt)


def test_a_nan_is_found_while_decoding_in_the_stored_dtype(tiny, tmp_path):
    model, tok, packs = tiny
    good = tmp_path / "good.kvpack"
    kvpack.save(_cast(packs["none"], torch.float16), good)
    bad = tmp_path / "nan.kvpack"
    values = bytearray(stored(good.read_bytes(), "values"))  # raw float16: element 7 forged into a NaN, re-signed
    values[14:16] = b"\x00\x7e"
    bad.write_bytes(restore(good.read_bytes(), {"values": bytes(values)}))
    with pytest.raises(CorruptFileError, match="nan.kvpack: layer 0's values hold values outside"):
        kvpack.load(bad, model, tokenizer=tok)


def test_load_bytes_and_the_budget_are_checked_before_anything_is_decoded(tiny, tmp_path):
    model, tok, packs = tiny
    path = tmp_path / "p.kvpack"
    kvpack.save(_cast(packs["none"], torch.float16), path)
    header = read_header(path)
    (e, d), layers_heads = header.tensors["keys"].shape, header.num_layers * header.kv_heads
    need = load_bytes(header, torch.float32)
    assert need == e * 2 * d * 4 + 8 * e + 12 * header.tokens + 4 * layers_heads
    assert kvpack.load(path, model, tokenizer=tok, max_bytes=need).nbytes() <= need
    damaged = tmp_path / "damaged.kvpack"  # its keys no longer match their checksum: decoding would say so
    damaged.write_bytes(restore(path.read_bytes(), sign=False)[:-1] + b"\x00")
    with pytest.raises(ChecksumMismatchError):
        kvpack.load(damaged, model, tokenizer=tok)
    with pytest.raises(MemoryBudgetError, match=rf"needs about {need:,} bytes .* more than the max_bytes limit "
                                                 rf"\(kvpack ask --max-memory\), {need - 1:,} bytes"):
        kvpack.load(damaged, model, tokenizer=tok, max_bytes=need - 1)
    for bad in (0, -5, 1.5, "1G"):
        with pytest.raises(InputError, match="max_bytes must be a positive integer"):
            kvpack.load(path, model, max_bytes=bad)


def test_ask_max_memory(tiny, tmp_path, monkeypatch):
    model, tok, packs = tiny
    path = tmp_path / "p.kvpack"
    kvpack.save(packs["none"], path)
    monkeypatch.setattr("kvpack.cli._load", lambda name, device, dtype: (model, tok))
    res = CliRunner().invoke(cli, ["ask", str(path), "What?", "--model", "tiny", "--max-memory", "1KiB",
                                   "--max-new-tokens", "1"])
    assert res.exit_code == 1 and "more than the max_bytes limit (kvpack ask --max-memory), 1,024 bytes" in res.output
    res = CliRunner().invoke(cli, ["ask", str(path), "What?", "--model", "tiny", "--max-memory", "lots"])
    assert res.exit_code == 1 and "--max-memory must be a positive size" in res.output
    assert parse_size("8GiB") == 8 << 30 and parse_size("1.5G") == 1_500_000_000 and parse_size("4096") == 4096


def test_info_reads_the_header_and_the_index_tensors_only(tiny, tmp_path):
    model, tok, packs = tiny
    path = tmp_path / "p.kvpack"
    kvpack.save(packs["int4"], path, zstd_level=3)
    header, index = read_index(path)
    pack = load_pack(path)
    assert index.kept_entries() == pack.kept_entries() and index.original_tokens == pack.original_tokens
    for a, b in zip(index.layers, pack.layers, strict=True):
        assert torch.equal(a.head_lengths, b.head_lengths) and torch.equal(a.quant.key_bits, b.quant.key_bits)
    arrays = read_index_arrays(path)[1]  # the same, as numpy arrays (kvpack info's, without torch)
    for a, b in zip(arrays.layers, index.layers, strict=True):
        assert isinstance(a.head_lengths, np.ndarray) and a.head_lengths.dtype == np.int64
        assert np.array_equal(a.head_lengths, b.head_lengths.numpy()) and np.array_equal(a.quant.key_bits,
                                                                                         b.quant.key_bits.numpy())
    frame = bytearray(stored(path.read_bytes(), "key_codes"))
    frame[len(frame) // 2] ^= 0xFF  # the codes are damaged (re-signed): verify refuses, info need not read them
    damaged = tmp_path / "codes.kvpack"
    damaged.write_bytes(restore(path.read_bytes(), {"key_codes": bytes(frame)}))
    with pytest.raises(CorruptFileError):
        load_pack(damaged)
    assert read_index(damaged)[1].kept_entries() == pack.kept_entries()
    lengths = restore(path.read_bytes(), sign=False)
    flipped = bytearray(lengths)
    at = lengths.index(stored(lengths, "head_lengths"))
    flipped[at + 2] ^= 1  # head_lengths' checksum no longer matches
    with pytest.raises((ChecksumMismatchError, CorruptFileError)):
        read_index(bytes(flipped))


_CHILD = r"""
import json, sys, kvpack
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
model, tok = kvpack.load_model(device="cpu")
before = status("VmRSS")
cache = kvpack.load(sys.argv[1], model)
print(json.dumps({"before": before, "peak": status("VmHWM"), "cache": cache.nbytes() + 8 * cache.token_ids.numel()}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_load_peak_memory_is_the_cache_plus_a_bounded_buffer(tmp_path):
    """A 256 MiB float16 pack (zstd) loaded into the float32 reference model: the process grows by the cache's own
    bytes (its layers and int64 token ids) plus less than 64 MiB (before issue 30 the stored tensors, decoded or
    mapped, were held besides: about 2.5x the cache)."""
    path = tmp_path / "big.kvpack"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_big_pack.py"), "--out", str(path), "--gib", "0.25",
                    "--zstd-level", "3"], check=True, capture_output=True, cwd=ROOT)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], check=True, capture_output=True, text=True,
                         cwd=ROOT)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["cache"] > 2 * path.stat().st_size * 0.95  # float32 rows of a float16 file
    assert r["peak"] - r["before"] <= r["cache"] + (64 << 20)
