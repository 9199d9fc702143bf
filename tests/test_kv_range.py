"""Loading refuses KV that a valid file can hold but attention cannot use (non-finite or beyond float16's range,
directly or through quantization parameters), the on-the-fly cache owns its memory, and ``kvpack ls``/``info``
print header strings without terminal control characters."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

import kvpack
from kvpack import constants as C
from kvpack.cli import cli
from kvpack.compact import dequantize_compact, dequantized_range, dequantized_ranges
from kvpack.errors import CorruptFileError, InputError
from kvpack.fileformat import load_pack
from kvpack.terminal import json_text, printable
from kvpack.loading import cache_from_pack

from .forge import with_float_element
from .tiny import TEXT, tiny_model


def _pack(quant="none"):
    """A llama tiny model, its tokenizer and a pack of TEXT; quantized ones have body rows in every layer."""
    model, tok = tiny_model("llama")
    pack = kvpack.compress(model, tok, TEXT, ratio=0.9, quant=quant, kv_dtype="float32")
    assert quant == "none" or all(int(l.quant.body_lengths.sum()) > 0 for l in pack.layers)
    return model, tok, pack


def test_dequantized_range_bounds_the_dequantized_rows_tightly():
    _, _, pack = _pack("int4")
    for layer in pack.layers:
        keys, values = dequantize_compact(layer.quant)
        low, high = dequantized_range(layer.quant)
        rows = torch.cat([keys.reshape(-1), values.reshape(-1)])
        assert low <= float(rows.min()) and float(rows.max()) <= high
        span = float(rows.abs().max())
        assert -4 * span <= low and high <= 4 * span  # a bound, not a guess: within a small factor of the data
    quants = [layer.quant for layer in pack.layers]
    assert dequantized_ranges(quants) == [dequantized_ranges([q])[0] for q in quants]  # all layers at once
    empty = dataclasses.replace(quants[0], body_lengths=torch.zeros_like(quants[0].body_lengths),
                                key_params=quants[0].key_params[:, :0], value_params=quants[0].value_params[:, :0])
    assert dequantized_ranges([empty, quants[1]]) == [(0.0, 0.0), dequantized_range(quants[1])]


@pytest.mark.parametrize("dequantize", ["at-load", "on-the-fly"])
@pytest.mark.parametrize("case", ["nan key", "inf value", "huge key", "grid scale base", "grid min step"])
def test_out_of_range_kv_is_refused_at_load(case, dequantize):
    model, tok, pack = _pack("none" if case in ("nan key", "inf value", "huge key") else "int4")
    layer = pack.layers[1]
    if case == "nan key":
        layer.keys[3, 1] = float("nan")
    elif case == "inf value":
        layer.values[0, 0] = float("inf")
    elif case == "huge key":
        layer.keys[2, 0] = 1e5  # finite in float32, beyond float16
    else:
        row = 2 if case == "grid scale base" else 1
        layer.quant.quant_grid[row] = 3e38  # finite and >= 0, so the format's checks pass
    with pytest.raises(CorruptFileError, match=r"layer 1's (keys|values|quantized rows) hold values outside"):
        cache_from_pack(pack, model, tok, dequantize=dequantize)


def test_values_at_the_limit_load_the_writer_refuses_nan_and_a_forged_nan_file_is_refused(tmp_path):
    model, tok, pack = _pack()
    assert pack.layers[0].values.dtype == torch.float32
    pack.layers[0].values[0, 0] = -C.MAX_KV_ABS
    cache_from_pack(pack, model, tok)  # the limit itself is allowed
    limit = tmp_path / "limit.kvpack"
    kvpack.save(pack, limit, zstd_level=0)
    kvpack.load(limit, model, tokenizer=tok)
    for value in (float("nan"), float("inf"), -65505.0):
        pack.layers[0].values[0, 0] = value
        with pytest.raises(InputError, match="cannot write this pack: layer 0's values hold values outside"):
            kvpack.save(pack, tmp_path / "bad.kvpack")
        assert not (tmp_path / "bad.kvpack").exists()
    bad = tmp_path / "nan.kvpack"  # the same file with the limit forged into a NaN: every format check passes
    bad.write_bytes(with_float_element(limit.read_bytes(), "values", 0, float("nan")))
    assert load_pack(bad).layers[0].values[0, 0].isnan()
    with pytest.raises(CorruptFileError, match="nan.kvpack: layer 0's values"):
        kvpack.load(bad, model, tokenizer=tok)


def test_the_on_the_fly_cache_does_not_share_the_files_memory(tmp_path):
    """Codes copied at load: the pack's tensors (views of the file's memory map) can change afterwards without
    reaching the cache (a file truncated after load would otherwise crash the process)."""
    model, tok, pack = _pack("int4")
    path = tmp_path / "q.kvpack"
    kvpack.save(pack, path)
    loaded = load_pack(path)
    cache = cache_from_pack(loaded, model, tok, dequantize="on-the-fly")
    layer = cache.layers[0]
    before = {k: v.clone() for k, v in layer.compact.items() if torch.is_tensor(v)}
    for t in (loaded.layers[0].quant.key_codes, loaded.layers[0].quant.value_codes, loaded.layers[0].keys):
        t.zero_()
    for k, v in before.items():
        assert torch.equal(layer.compact[k], v), k
    assert not torch.equal(layer.entries.quant.key_codes, loaded.layers[0].quant.key_codes)


def test_the_at_load_cache_does_not_share_the_files_memory(tmp_path):
    """The same for the default layout of an Attention Matching pack: keys, values and biases are copies."""
    model, tok = tiny_model("llama")
    pack = kvpack.compress(model, tok, TEXT, method="am", ratio=0.3, chunk_size=40, value_bound=0)  # fitted biases
    path = tmp_path / "am.kvpack"
    kvpack.save(pack, path)
    loaded = load_pack(path)
    cache = cache_from_pack(loaded, model, tok)
    layer = cache.layers[0]
    before = [t.clone() for t in (layer.kept_keys, layer.kept_values, layer.biases)]
    assert bool(before[2].any())
    for t in (loaded.layers[0].keys, loaded.layers[0].values, loaded.layers[0].biases):
        t.zero_()
    for got, want in zip((layer.kept_keys, layer.kept_values, layer.biases), before):
        assert torch.equal(got, want)


def test_printable_escapes_what_a_terminal_would_act_on():
    assert printable("notes.txt") == "notes.txt"
    assert printable("a\x1b[2Jb\x07") == "a\\x1b[2Jb\\x07"
    assert printable("\x9b31m \u202eevil \u00e9\u6587") == "\\x9b31m \\u202eevil \u00e9\u6587"
    assert printable(printable("a\x1bb")) == printable("a\x1bb")
    assert printable("no\u00a0break, \U0001f469\u200d\U0001f4bb") == "no\u00a0break, \U0001f469\u200d\U0001f4bb"
    assert printable("a\nb\u2028c\ud800") == "a\\nb\\u2028c\\ud800"
    assert printable("a\nb\tc\x1b", keep="\n\t") == "a\nb\tc\\x1b"  # an answer's lines stay lines


def test_json_text_is_the_same_json_with_terminal_controls_escaped():
    value = {"s\x9b": ["\x1b[2J\x9b31m\u202eevil\u2028\x7f", "é文 \U0001f469\u200d\U0001f4bb", 1.5, None]}
    out = json_text(value, indent=1)
    assert json.loads(out) == value
    assert all(not (ord(c) >= 0x7f and printable(c) != c) for c in out) and "\x1b" not in out
    assert "é文 \U0001f469\u200d\U0001f4bb" in out  # readable text stays as it is


def test_ls_and_info_print_no_control_characters(tmp_path):
    model, tok = tiny_model("llama")
    pack = kvpack.compress(model, tok, TEXT, ratio=0.5, source_name="\x1b]0;owned\x07\x1b[2J\x9b31mevil.txt")
    pack.metadata["method"] = "\x1b[31mkvzip"
    kvpack.save(pack, tmp_path / "x.kvpack")
    for args in (["ls", str(tmp_path)], ["info", str(tmp_path / "x.kvpack")]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output and "\x07" not in result.output and "\x9b" not in result.output
        assert "\\x1b" in result.output
        result = CliRunner().invoke(cli, args + ["--json"])  # the same JSON values, no raw C1 control either
        assert result.exit_code == 0 and "\x9b" not in result.output and "\\u009b" in result.output
