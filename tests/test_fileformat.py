"""The format-1.0 writer and reader on valid packs: golden bytes, round trips, determinism, safetensors, sources (path,
file object, bytes), streaming and memory maps, attention biases, atomic save and stale temporary files."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import safetensors
import torch
import zstandard

from kvpack import constants as C
from kvpack.storage import remove_stale_temps
from kvpack.errors import CorruptFileError, InputError, ModelMismatchError, TruncatedFileError
from kvpack.fileformat import PackHeader, load_pack, pack_to_bytes, read_header, save, verify
from kvpack.pack import LayerEntries, Pack
from kvpack.quant import quantize_pack

from .golden_packs import GOLDEN, GOLDEN_DIR, GOLDEN_ZSTD_LIBRARY, golden_f32, golden_int4

QUANT_FIELDS = ("qtype", "group_size", "sink_lengths", "body_lengths", *C.COMPACT_PARTS)


def assert_packs_equal(a: Pack, b: Pack) -> None:
    """Exact equality: values, dtypes, shapes, quantized rows, biases, sink tokens and metadata."""
    assert a.sink_tokens == b.sink_tokens and a.metadata == b.metadata
    assert a.token_ids.dtype == b.token_ids.dtype and torch.equal(a.token_ids, b.token_ids)
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        for name in ("keys", "values", "positions", "head_lengths"):
            x, y = getattr(la, name), getattr(lb, name)
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
        assert (la.biases is None) == (lb.biases is None)
        if la.biases is not None:
            assert torch.equal(la.biases, lb.biases)
        assert (la.quant is None) == (lb.quant is None)
        if la.quant is not None:
            for name in QUANT_FIELDS:
                x, y = getattr(la.quant, name), getattr(lb.quant, name)
                if isinstance(x, torch.Tensor):
                    assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
                else:
                    assert x == y, name


def random_pack(dtype: torch.dtype, head_lengths: list[list[int]], head_dim: int = 8, head_dim_v: int = 8,
                tokens: int = 40, biases: bool = False) -> Pack:
    """A pack with random values; head h of layer l keeps ``head_lengths[l][h]`` sorted random positions."""
    g = torch.Generator().manual_seed(0)
    layers = []
    for lengths in head_lengths:
        pos = [torch.randperm(tokens, generator=g)[:n].sort().values for n in lengths]
        n = sum(lengths)
        layers.append(LayerEntries(
            keys=torch.randn(n, head_dim, generator=g).to(dtype),
            values=torch.randn(n, head_dim_v, generator=g).to(dtype),
            positions=torch.cat(pos).to(torch.int32),
            head_lengths=torch.tensor(lengths, dtype=torch.int64),
            biases=(torch.rand(n, generator=g) * 60 - 30) if biases else None,
        ))
    return Pack(token_ids=torch.randint(0, 50_000, (tokens,), generator=g), layers=layers,
                sink_tokens=min(tokens, 4), metadata={"method": "random", "ratio": 0.3,
                                                      "stats": {"x": [1, 2.5, None, True]}})


def _zstd_library_differs() -> bool:
    return tuple(zstandard.ZSTD_VERSION) != GOLDEN_ZSTD_LIBRARY


# --- golden files -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_writer_reproduces_golden_bytes(name):
    make, level, checksum = GOLDEN[name]
    if level and _zstd_library_differs():
        pytest.skip("zstd output depends on the zstd library version")
    assert pack_to_bytes(make(), level, checksum) == (GOLDEN_DIR / name).read_bytes()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_loads_to_constructed_pack(name):
    make, level, checksum = GOLDEN[name]
    pack = load_pack(GOLDEN_DIR / name)
    assert_packs_equal(pack, load_pack((GOLDEN_DIR / name).read_bytes()))
    want = make()
    for layer in want.layers:  # a file with biases gives every layer its slice (zeros where none were given)
        if any(e.biases is not None for e in want.layers) and layer.biases is None:
            layer.biases = torch.zeros(layer.num_entries)
    want.token_ids = want.token_ids.to(torch.int64)
    for layer in want.layers:
        layer.positions = layer.positions.to(torch.int32)
    assert_packs_equal(pack, want)
    header = verify(GOLDEN_DIR / name)
    assert (header.format_version, header.zstd_level, header.checksum) == ("1.0", level, checksum)


def test_golden_starts_with_magic_and_one_version():
    for name in GOLDEN:
        data = (GOLDEN_DIR / name).read_bytes()
        assert data[8 : 8 + len(C.MAGIC)] == C.MAGIC
        assert b'"format_version":"1.0"' in data[: 8 + int.from_bytes(data[:8], "little")]


def test_biases_file_layout():
    """attn_bias is one F32 tensor over all entries, layer after layer; layer 1 (no biases given) reads as zeros;
    a file without it reads exactly as before (biases None)."""
    pack = load_pack(GOLDEN_DIR / "small_f32_biases.kvpack")
    assert pack.layers[0].biases.tolist() == [-30.0, -0.5, 0.0, 2.25, 30.0, 1.0, -1.0]
    assert pack.layers[1].biases.tolist() == [0.0] * 5
    header = read_header(GOLDEN_DIR / "small_f32_biases.kvpack")
    assert header.has_biases and header.tensors["attn_bias"].shape == (12,)
    plain = load_pack(GOLDEN_DIR / "small_f32.kvpack")
    assert all(layer.biases is None for layer in plain.layers)
    for a, b in zip(pack.layers, plain.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.positions, b.positions)
    assert pack.layers[0].dequantized(torch.float16).biases is pack.layers[0].biases


# --- round trips ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("qtype", ["none", "int4", "int8"])
@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
def test_round_trip(dtype, level, qtype, checksum):
    pack = random_pack(dtype, [[40, 7, 0], [33, 2, 25]], head_dim=8, head_dim_v=8, tokens=40, biases=qtype == "int4")
    if qtype != "none":
        pack = quantize_pack(pack, qtype, 32)
    data = pack_to_bytes(pack, level, checksum)
    back = load_pack(data)
    assert_packs_equal(back, pack)
    assert pack_to_bytes(back, level, checksum) == data
    header = read_header(data)
    assert (header.checksum, header.zstd_level, header.quant_type) == (checksum, level, qtype)
    assert header.has_biases == (qtype == "int4")


def test_zero_entry_heads_and_layers():
    pack = random_pack(torch.float32, [[0, 0], [3, 0], [0, 5]])
    assert_packs_equal(load_pack(pack_to_bytes(pack, 3)), pack)


def test_same_pack_same_bytes_whatever_the_insertion_order_and_strides():
    a, b = golden_f32(), golden_f32()
    b.metadata = dict(reversed(list(b.metadata.items())))
    b.layers[0].keys = b.layers[0].keys.t().contiguous().t()
    assert pack_to_bytes(a) == pack_to_bytes(b)


def test_layers_with_other_dtypes_are_refused():
    pack = golden_f32()
    pack.layers[1].keys = pack.layers[1].keys.to(torch.float16)
    with pytest.raises(InputError, match="one dtype for all keys"):
        pack_to_bytes(pack)


@pytest.mark.parametrize("bad", [torch.tensor([float("nan")] * 7), torch.full((7,), 30.5), torch.zeros(6),
                                 torch.zeros(7, dtype=torch.float64)])
def test_bad_biases_are_refused(bad):
    pack = golden_f32()
    pack.layers[0].biases = bad
    with pytest.raises(InputError, match="biases"):
        pack_to_bytes(pack)


def _bad_packs():
    p1 = golden_f32(); p1.layers[0].keys = p1.layers[0].keys.double()
    p2 = golden_f32(); p2.metadata["sink_tokens"] = 3
    p3 = golden_f32(); p3.metadata["stats"] = {"x": float("nan")}
    p4 = golden_f32(); p4.layers[1].positions = p4.layers[1].positions.flip(0)
    p5 = golden_f32(); p5.layers[0].head_lengths = torch.tensor([4, 4])
    p6 = golden_f32(); p6.sink_tokens = 9
    p7 = golden_f32(); p7.metadata["obj"] = object()
    p8 = golden_f32(); p8.token_ids = torch.tensor([2**31] * 8)
    p9 = golden_int4(); p9.layers[1].quant.key_bits = p9.layers[1].quant.key_bits + 1
    return [p1, p2, p3, p4, p5, p6, p7, p8, p9, "not a pack"]


@pytest.mark.parametrize("pack", _bad_packs())
def test_writer_rejects_inconsistent_packs(pack):
    with pytest.raises(InputError, match="cannot write this pack"):
        pack_to_bytes(pack)


@pytest.mark.parametrize("level,checksum", [(-1, "xxh3"), (23, "xxh3"), (True, "xxh3"), (0, "md5"), (0, None)])
def test_bad_storage_arguments_are_input_errors(level, checksum):
    with pytest.raises(InputError, match="zstd_level|checksum"):
        pack_to_bytes(golden_f32(), level, checksum)


# --- safetensors compatibility ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["small_f32.kvpack", "small_bf16.kvpack", "small_int4.kvpack"])
def test_safetensors_can_open(name):
    make = GOLDEN[name][0]
    pack = make()
    with safetensors.safe_open(str(GOLDEN_DIR / name), "pt") as f:
        meta = f.metadata()
        assert meta[C.META_FORMAT] == "kvpack" and meta[C.META_FORMAT_VERSION] == "1.0"
        assert json.loads(meta[C.META_KVPACK])["sink_tokens"] == pack.sink_tokens
        assert torch.equal(f.get_tensor("token_ids"), pack.token_ids.to(torch.int32))
        assert torch.equal(f.get_tensor("head_lengths"), pack.head_lengths().to(torch.int32))
        assert torch.equal(f.get_tensor("keys"), torch.cat([layer.keys for layer in pack.layers]))
        assert torch.equal(f.get_tensor("positions"), torch.cat([layer.positions for layer in pack.layers]))


def test_read_header():
    path = GOLDEN_DIR / "small_f32.kvpack"
    header = read_header(path)
    assert isinstance(header, PackHeader)
    assert header.format_version == "1.0" and header.quant_layout is None and not header.has_biases
    assert header.metadata["sink_tokens"] == 2 and header.metadata["method"] == "keynorm"
    assert (header.num_layers, header.kv_heads, header.tokens, header.entries) == (2, 2, 8, 12)
    assert header.head_dims == (4, 4) and header.kv_dtype == torch.float32
    sections = header.bytes_by_section()
    assert list(sections) == ["header", "token_ids", "head_lengths", "keys", "values", "positions"]
    assert sum(sections.values()) == header.file_bytes == path.stat().st_size
    assert sections["keys"] == 12 * 4 * 4 and sections["positions"] == 12 * 4
    assert verify(path) == header
    q = read_header(GOLDEN_DIR / "small_int4.kvpack")
    assert (q.quant_type, q.group_size, q.quant_layout) == ("int4", 32, "compact")


# --- sources, streaming, memory maps ----------------------------------------------------------------------------


class _Unbuffered:
    """A seekable binary file object with only ``read`` and ``seek`` (no ``readinto``, no ``fileno``)."""

    def __init__(self, data: bytes):
        self._data, self._pos, self.reads = data, 0, 0

    def seek(self, pos, whence=0):
        self._pos = {0: pos, 1: self._pos + pos, 2: len(self._data) + pos}[whence]
        return self._pos

    def read(self, n=-1):
        self.reads += 1
        out = self._data[self._pos :] if n < 0 else self._data[self._pos : self._pos + n]
        self._pos += len(out)
        return out


@pytest.mark.parametrize("name", ["small_f32.kvpack", "small_int4_zstd.kvpack", "small_f32_biases.kvpack"])
def test_file_objects_read_like_paths(name):
    path = GOLDEN_DIR / name
    want = load_pack(path)
    with open(path, "rb") as f:
        assert_packs_equal(load_pack(f), want)
        assert not f.closed  # the caller's file stays open
    f = _Unbuffered(path.read_bytes())
    assert_packs_equal(load_pack(f), want)
    assert_packs_equal(load_pack(io.BufferedReader(io.BytesIO(path.read_bytes()))), want)
    assert verify(_Unbuffered(path.read_bytes())) == read_header(path)
    with pytest.raises(TruncatedFileError):
        load_pack(_Unbuffered(path.read_bytes()[:-1]))


def test_truncation_messages_give_the_file_size_and_what_the_header_declares(tmp_path):
    data = (GOLDEN_DIR / "small_f32.kvpack").read_bytes()
    n = int.from_bytes(data[:8], "little")
    cut = tmp_path / "cut.kvpack"
    cut.write_bytes(data[:-10])
    with pytest.raises(TruncatedFileError, match=rf"cut inside its data: the file has {len(data) - 10:,} bytes of "
                                                 rf"the {len(data):,} its header declares"):
        load_pack(cut)
    cut.write_bytes(data[: n - 8])
    with pytest.raises(TruncatedFileError, match=rf"cut inside its header: the file has {n - 8:,} bytes, but its "
                                                 rf"length prefix declares a {n:,}-byte header"):
        read_header(cut)


def test_raw_tensors_of_a_path_are_memory_mapped_and_private(tmp_path):
    path = tmp_path / "a.kvpack"
    save(random_pack(torch.float32, [[300, 200]], head_dim=64, head_dim_v=64, tokens=400), path)
    pack = load_pack(path)
    keys = pack.layers[0].keys
    base = keys.untyped_storage()
    assert isinstance(base, torch.UntypedStorage)
    before = path.read_bytes()
    keys.add_(1.0)  # copy-on-write: the file is untouched
    assert path.read_bytes() == before
    assert not torch.equal(load_pack(path).layers[0].keys, keys)


def test_sparse_file_over_2_gib_is_read_in_bounded_chunks(tmp_path):
    """A pack whose keys span more than 2 GiB: a sparse file (holes read as zeros) written with the spec's rules;
    ``verify`` streams it through the checksum in READ_CHUNK_BYTES pieces and ``load_pack`` maps it."""
    import hashlib
    import xxhash

    from .forge import canon

    rows, d = (2**31 + 2**20) // 256, 64  # F32 [rows, 64]: 2 GiB + 1 MiB of zeros per tensor
    nbytes = rows * d * 4
    zero_chunk = bytes(C.READ_CHUNK_BYTES)
    h = xxhash.xxh3_128()
    left = nbytes
    while left:
        n = min(left, len(zero_chunk))
        h.update(zero_chunk[:n])
        left -= n
    zeros_digest = h.hexdigest()
    small = {"head_lengths": np.array([rows], dtype="<i4").tobytes(), "positions": np.arange(rows, dtype="<i4"),
             "token_ids": np.zeros(rows, dtype="<i4")}
    index, blobs, end = {}, [], 0
    for name, code, shape in (("head_lengths", "I32", [1, 1]), ("keys", "F32", [rows, d]),
                              ("positions", "I32", [rows]), ("token_ids", "I32", [rows]), ("values", "F32", [rows, d])):
        size = nbytes if name in ("keys", "values") else len(bytes(small[name]))
        index[name] = {"dtype": code, "shape": shape, "data_offsets": [end, end + size]}
        blobs.append((name, size))
        end += size
    sums = {n: zeros_digest if n in ("keys", "values") else xxhash.xxh3_128_hexdigest(bytes(small[n]))
            for n, _ in blobs}
    meta = {"format": "kvpack", "format_version": "1.0", "kvpack": canon({"sink_tokens": 0}).decode(),
            "tensor_xxh3": canon(sums).decode()}
    obj = {"__metadata__": meta, **index}
    meta["header_sha256"] = hashlib.sha256(canon(obj)).hexdigest()
    text = canon(obj)
    text += b" " * (-len(text) % 8)
    path = tmp_path / "big.kvpack"
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, size in blobs:
            if name in ("keys", "values"):
                f.seek(size, os.SEEK_CUR)  # a hole: zeros
            else:
                f.write(bytes(small[name]))
        f.truncate()
    assert path.stat().st_size > 2**32
    header = read_header(path)
    assert header.tensors["keys"].nbytes > 2**31
    assert verify(path).entries == rows
    pack = load_pack(path)
    assert pack.layers[0].keys.shape == (rows, d) and float(pack.layers[0].keys[-1, -1]) == 0.0
    assert int(pack.layers[0].positions[-1]) == rows - 1


def test_verify_memory_is_bounded(tmp_path):
    """verify holds the index tensors and one chunk, not the keys and values (a 64 MB pack)."""
    import tracemalloc

    path = tmp_path / "a.kvpack"
    save(random_pack(torch.float32, [[8000, 8000]], head_dim=512, head_dim_v=512, tokens=8000), path, zstd_level=1)
    size = path.stat().st_size
    assert size > 30_000_000
    tracemalloc.start()
    try:
        verify(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < C.READ_CHUNK_BYTES * 3 + 2_000_000 < size


# --- model checks on load ---------------------------------------------------------------------------------------


def test_load_checks_shapes_against_the_model_naming_both_sides(tmp_path):
    import kvpack

    from .tiny import TEXT, tiny_model

    model, tok = tiny_model("llama")
    pack = kvpack.compress(model, tok, TEXT, ratio=0.5, chunk_size=64)
    meta = {k: v for k, v in pack.metadata.items() if k != "layer_kinds"}
    fewer = Pack(pack.token_ids, pack.layers[:-1], pack.sink_tokens, meta)
    save(fewer, tmp_path / "fewer.kvpack")
    with pytest.raises(ModelMismatchError, match=rf"layers: the pack has {len(pack.layers) - 1}, the model "
                                                  rf"{len(pack.layers)}"):
        kvpack.load(tmp_path / "fewer.kvpack", model)
    narrow = Pack(pack.token_ids, [LayerEntries(l.keys[:, :-2].contiguous(), l.values[:, :-2].contiguous(),
                                                l.positions, l.head_lengths) for l in pack.layers],
                  pack.sink_tokens, pack.metadata)
    save(narrow, tmp_path / "narrow.kvpack")
    d = pack.layers[0].keys.shape[1]
    with pytest.raises(ModelMismatchError, match=f"key head size: the pack has {d - 2}, the model {d}"):
        kvpack.load(tmp_path / "narrow.kvpack", model)


# --- atomic save and temporary files ----------------------------------------------------------------------------


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def test_save_failure_in_replace_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "ctx.kvpack"
    path.write_bytes(b"old contents")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(InputError, match="ctx.kvpack"):
        save(golden_f32(), path)
    assert path.read_bytes() == b"old contents" and _leftovers(tmp_path) == []


def test_save_failure_in_write_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "ctx.kvpack"
    path.write_bytes(b"old contents")

    def broken_fsync(fd):
        raise KeyboardInterrupt  # not an OSError: must still clean up and propagate unchanged

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(KeyboardInterrupt):
        save(golden_f32(), path)
    assert path.read_bytes() == b"old contents" and _leftovers(tmp_path) == []


def test_save_replaces_existing_file_and_bad_folder_is_input_error(tmp_path):
    path = tmp_path / "ctx.kvpack"
    path.write_bytes(b"old contents")
    n = save(golden_f32(), path)
    assert path.read_bytes() == (GOLDEN_DIR / "small_f32.kvpack").read_bytes() and n == path.stat().st_size
    assert _leftovers(tmp_path) == []
    with pytest.raises(InputError, match="folder exists"):
        save(golden_f32(), tmp_path / "missing" / "x.kvpack")


_SLOW_WRITER = textwrap.dedent("""
    import os, sys, time
    import kvpack.storage as s
    real = os.fsync
    def slow(fd):
        print("writing", flush=True)
        time.sleep(float(sys.argv[2]))
        real(fd)
    os.fsync = slow
    s.write_atomic(sys.argv[1], [b"x" * 1000])
""")


def _start_writer(target, seconds: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(target), str(seconds)], stdout=subprocess.PIPE,
                            env=env, text=True)
    assert proc.stdout.readline().strip() == "writing"  # its temporary file exists now
    return proc


def test_temp_file_of_a_killed_save_is_removed_by_the_next_save(tmp_path):
    proc = _start_writer(tmp_path / "a.kvpack", 60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stale = _leftovers(tmp_path)
    assert len(stale) == 1 and f".tmp.{proc.pid}." in stale[0]
    save(golden_f32(), tmp_path / "b.kvpack")
    assert _leftovers(tmp_path) == [] and (tmp_path / "b.kvpack").is_file() and not (tmp_path / "a.kvpack").exists()


def test_temp_file_of_a_live_writer_is_kept(tmp_path):
    proc = _start_writer(tmp_path / "a.kvpack", 3)
    try:
        assert len(_leftovers(tmp_path)) == 1
        save(golden_f32(), tmp_path / "b.kvpack")  # cleans the folder, but the writer is alive
        assert len(_leftovers(tmp_path)) == 1
        assert remove_stale_temps(tmp_path) == []
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0 and (tmp_path / "a.kvpack").read_bytes() == b"x" * 1000
    assert _leftovers(tmp_path) == []


def test_other_files_are_never_removed(tmp_path):
    keep = ["notes.tmp.txt", "a.kvpack.tmp.12.zz", "a.kvpack.tmp.1.0123456789", "b.kvpack"]
    for name in keep:
        (tmp_path / name).write_bytes(b"x")
    dead = "a.kvpack.tmp.999999999.0123abcd"  # no such process
    (tmp_path / dead).write_bytes(b"x")
    assert remove_stale_temps(tmp_path) == [str(tmp_path / dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


def test_unreadable_sources_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="check the path"):
        load_pack(tmp_path / "nope.kvpack")
    with pytest.raises(InputError, match="not a regular file"):
        read_header(tmp_path)
    with pytest.raises(InputError):
        verify(42)
    with pytest.raises(CorruptFileError):
        load_pack(b"\x30" + bytes(7) + b'{"__metadata__":{"format":"kvpack","x":1}}' + bytes(6))
