"""The .kvpack v1 writer and reader on valid packs: golden bytes, round trips, determinism, safetensors, atomic save."""

from __future__ import annotations

import json
import os

import pytest
import safetensors
import torch

from kvpack import constants as C
from kvpack.errors import InputError
from kvpack.fileformat import PackHeader, load_pack, pack_to_bytes, read_header, save, verify
from kvpack.pack import LayerEntries, Pack

from .golden_packs import GOLDEN, GOLDEN_DIR, golden_f32


def assert_packs_equal(a: Pack, b: Pack) -> None:
    """Exact equality: values, dtypes, shapes, sink tokens and metadata."""
    assert a.sink_tokens == b.sink_tokens
    assert a.metadata == b.metadata
    assert a.token_ids.dtype == b.token_ids.dtype and torch.equal(a.token_ids, b.token_ids)
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        for name in ("keys", "values", "positions", "head_lengths"):
            x, y = getattr(la, name), getattr(lb, name)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x, y), name


def random_pack(
    dtype: torch.dtype, head_lengths: list[list[int]], head_dim: int = 8, head_dim_v: int = 8, tokens: int = 40
) -> Pack:
    """A pack with random values; head h of layer l keeps ``head_lengths[l][h]`` sorted random positions."""
    g = torch.Generator().manual_seed(0)
    layers = []
    for lengths in head_lengths:
        pos = [torch.randperm(tokens, generator=g)[:n].sort().values for n in lengths]
        n = sum(lengths)
        layers.append(
            LayerEntries(
                keys=torch.randn(n, head_dim, generator=g).to(dtype),
                values=torch.randn(n, head_dim_v, generator=g).to(dtype),
                positions=torch.cat(pos).to(torch.int32),
                head_lengths=torch.tensor(lengths, dtype=torch.int64),
            )
        )
    return Pack(
        token_ids=torch.randint(0, 50_000, (tokens,), generator=g),
        layers=layers,
        sink_tokens=min(tokens, 4),
        metadata={"method": "random", "ratio": 0.3, "stats": {"x": [1, 2.5, None, True]}},
    )


# --- golden files -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_writer_reproduces_golden_bytes(name):
    assert pack_to_bytes(GOLDEN[name](), checksum="sha256") == (GOLDEN_DIR / name).read_bytes()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_loads_to_constructed_pack(name):
    assert_packs_equal(load_pack(GOLDEN_DIR / name), GOLDEN[name]())


def test_golden_starts_with_magic():
    data = (GOLDEN_DIR / "small_f32.kvpack").read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert data[C.MAGIC_OFFSET : C.MAGIC_OFFSET + len(C.MAGIC)] == C.MAGIC
    assert n % 8 == 0 and data[8 + n - 1 : 8 + n] in (b" ", b"}")


# --- round trips ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip(tmp_path, dtype):
    pack = random_pack(dtype, [[5, 0, 3, 7], [1, 2, 3, 4], [0, 0, 0, 9]], head_dim=8, head_dim_v=6)
    path = tmp_path / "a.kvpack"
    written = save(pack, path)
    assert written == path.stat().st_size
    loaded = load_pack(path)
    assert_packs_equal(loaded, pack)
    assert loaded.token_ids.dtype == torch.int64 and loaded.layers[0].positions.dtype == torch.int32
    assert loaded.layers[0].head_lengths.dtype == torch.int64
    assert_packs_equal(load_pack(path.read_bytes()), pack)
    assert_packs_equal(load_pack(str(path)), pack)


def test_loaded_tensors_are_independent_copies():
    data = bytearray((GOLDEN_DIR / "small_f32.kvpack").read_bytes())
    pack = load_pack(data)
    data[-40:] = bytes(40)
    pack.layers[0].keys += 1  # writable
    assert torch.equal(pack.token_ids, golden_f32().token_ids)


def test_zero_entry_heads_and_layers(tmp_path):
    pack = random_pack(torch.float16, [[0, 0], [0, 3], [0, 0]], tokens=5)
    pack.sink_tokens = 0
    assert_packs_equal(load_pack(pack_to_bytes(pack)), pack)
    empty = random_pack(torch.float32, [[0, 0, 0]], tokens=0)
    empty.sink_tokens = 0
    assert_packs_equal(load_pack(pack_to_bytes(empty)), empty)


def test_int32_positions_and_int64_inputs_are_accepted():
    pack = golden_f32()
    for layer in pack.layers:
        layer.positions = layer.positions.to(torch.int64)
        layer.head_lengths = layer.head_lengths.to(torch.int32)
    assert pack_to_bytes(pack, checksum="sha256") == (GOLDEN_DIR / "small_f32.kvpack").read_bytes()


# --- determinism ------------------------------------------------------------------------------------------------


def test_same_pack_same_bytes():
    assert pack_to_bytes(golden_f32()) == pack_to_bytes(golden_f32())


def test_metadata_insertion_order_does_not_change_bytes():
    a, b = golden_f32(), golden_f32()
    b.metadata = dict(reversed(list(b.metadata.items())))
    b.metadata["fingerprint"] = dict(reversed(list(b.metadata["fingerprint"].items())))
    assert list(a.metadata) != list(b.metadata)
    assert pack_to_bytes(a) == pack_to_bytes(b)


def test_non_contiguous_input_gives_same_bytes():
    a, b = golden_f32(), golden_f32()
    b.layers[0].keys = b.layers[0].keys.t().contiguous().t()
    assert not b.layers[0].keys.is_contiguous()
    assert pack_to_bytes(a) == pack_to_bytes(b)


# --- safetensors compatibility ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_safetensors_can_open(name):
    path = GOLDEN_DIR / name
    pack = GOLDEN[name]()
    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert meta[C.META_FORMAT] == "kvpack" and meta[C.META_FORMAT_VERSION] == "1"
        assert json.loads(meta[C.META_KVPACK])["sink_tokens"] == pack.sink_tokens
        assert torch.equal(f.get_tensor("token_ids"), pack.token_ids.to(torch.int32))
        assert torch.equal(f.get_tensor("head_lengths"), pack.head_lengths().to(torch.int32))
        for l, layer in enumerate(pack.layers):
            assert torch.equal(f.get_tensor(f"layers.{l}.keys"), layer.keys)
            assert torch.equal(f.get_tensor(f"layers.{l}.values"), layer.values)
            assert torch.equal(f.get_tensor(f"layers.{l}.positions"), layer.positions)


# --- header -----------------------------------------------------------------------------------------------------


def test_read_header():
    path = GOLDEN_DIR / "small_f32.kvpack"
    header = read_header(path)
    assert isinstance(header, PackHeader)
    assert header.format_version == 1
    assert header.metadata["sink_tokens"] == 2 and header.metadata["method"] == "keynorm"
    assert (header.num_layers, header.kv_heads, header.tokens) == (2, 2, 8)
    assert header.tensors["layers.0.keys"].dtype == "F32" and header.tensors["layers.0.keys"].shape == (7, 4)
    sections = header.bytes_by_section()
    assert list(sections) == ["header", "token_ids", "head_lengths", "keys", "values", "positions"]
    assert sum(sections.values()) == header.file_bytes == path.stat().st_size
    assert sections["keys"] == (7 + 5) * 4 * 4 and sections["positions"] == 12 * 4
    assert verify(path) == header


# --- writer input checks ----------------------------------------------------------------------------------------


def _bad_packs():
    p1 = golden_f32(); p1.layers[0].keys = p1.layers[0].keys.double()
    p2 = golden_f32(); p2.metadata["sink_tokens"] = 3
    p3 = golden_f32(); p3.metadata["stats"] = {"x": float("nan")}
    p4 = golden_f32(); p4.layers[1].positions = p4.layers[1].positions.flip(0)
    p5 = golden_f32(); p5.layers[0].head_lengths = torch.tensor([4, 4])
    p6 = golden_f32(); p6.sink_tokens = 9
    p7 = golden_f32(); p7.metadata["obj"] = object()
    p8 = golden_f32(); p8.token_ids = torch.tensor([2**31] * 8)
    return [p1, p2, p3, p4, p5, p6, p7, p8, "not a pack"]


@pytest.mark.parametrize("pack", _bad_packs())
def test_writer_rejects_inconsistent_packs(pack):
    with pytest.raises(InputError, match="cannot write this pack"):
        pack_to_bytes(pack)


# --- atomic save ------------------------------------------------------------------------------------------------


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def test_save_failure_in_replace_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "ctx.kvpack"
    path.write_bytes(b"old contents")

    def broken_replace(src, dst):
        assert os.path.basename(src).startswith("ctx.kvpack") and ".tmp" in os.path.basename(src)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(InputError, match="ctx.kvpack"):
        save(golden_f32(), path)
    assert path.read_bytes() == b"old contents"
    assert _leftovers(tmp_path) == []


def test_save_failure_in_write_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "ctx.kvpack"
    path.write_bytes(b"old contents")

    def broken_fsync(fd):
        raise KeyboardInterrupt  # not an OSError: must still clean up and propagate unchanged

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(KeyboardInterrupt):
        save(golden_f32(), path)
    assert path.read_bytes() == b"old contents"
    assert _leftovers(tmp_path) == []


def test_save_replaces_existing_file_and_bad_folder_is_input_error(tmp_path):
    path = tmp_path / "ctx.kvpack"
    path.write_bytes(b"old contents")
    n = save(golden_f32(), path)
    assert path.read_bytes() == (GOLDEN_DIR / "small_f32_xxh3.kvpack").read_bytes() and n == path.stat().st_size
    assert _leftovers(tmp_path) == []
    with pytest.raises(InputError, match="folder exists"):
        save(golden_f32(), tmp_path / "missing" / "x.kvpack")


def test_unreadable_paths_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="check the path"):
        load_pack(tmp_path / "nope.kvpack")
    with pytest.raises(InputError, match="not a regular file"):
        read_header(tmp_path)
    with pytest.raises(InputError):
        verify(42)
