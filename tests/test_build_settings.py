"""``kvpack.build_settings``: one checked, frozen type for a build's settings, its JSON (the manifest's and the
up-to-date checks') and the checks it shares with ``kvpack.compress`` and the benchmark."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from kvpack.bench.grid import expand_grid
from kvpack.build import build, discover_contexts, plan_build
from kvpack.build_settings import BuildSettings, check_chunk_size, check_quant, check_ratio
from kvpack.errors import InputError

from .tiny import TEXT, tiny_model

KVZIP_PARAMS = {"chunk_size": 2048, "tail_tokens": 8, "scoring": "attention", "max_head_ratio": 1.0}


def test_to_json_is_what_packs_and_manifests_record():
    assert BuildSettings.make(method="kvzip", ratio=0.3).to_json() == {
        "method": "kvzip", "method_params": KVZIP_PARAMS, "ratio": 0.3, "quant": ["none", None, None],
        "zstd_level": 3, "checksum": "xxh3", "kv_dtype": "auto", "chunk_size": 2048, "options": {}}
    s = BuildSettings.make(method="d2o", ratio=0.5, chunk_size=64, quant="int4", group_size=64, zstd_level=0,
                           checksum="sha256", kv_dtype="float32", beta=0.5, merge="off")
    assert s.to_json() == {
        "method": "d2o", "method_params": {"sink": 4, "recent_ratio": 0.25, "merge": "off", "beta": 0.5},
        "ratio": 0.5, "quant": ["int4", 64, "compact"], "zstd_level": 0, "checksum": "sha256",
        "kv_dtype": "float32", "chunk_size": 64, "options": {"beta": 0.5, "merge": "off"}}
    assert list(s.to_json()) == ["method", "method_params", "ratio", "quant", "zstd_level", "checksum", "kv_dtype",
                                 "chunk_size", "options"]  # the manifest's key order, as before
    # what compress and save are given
    assert s.compress_kwargs() == {"method": "d2o", "ratio": 0.5, "chunk_size": 64, "quant": "int4", "group_size": 64,
                                   "kv_dtype": "float32", "beta": 0.5, "merge": "off"}
    assert (s.zstd_level, s.checksum) == (0, "sha256")
    plain = BuildSettings.make(quant="none", group_size=64)  # the group size of an unquantized build is not kept
    assert plain.group_size is None and plain.to_json()["quant"] == ["none", None, None]
    assert plain.compress_kwargs()["group_size"] == 32


def test_method_none_records_ratio_one_and_an_int_ratio_is_a_float():
    s = BuildSettings.make(method="none", ratio=0.2)
    assert s.ratio == 1.0 and s.to_json()["ratio"] == 1.0 and s.method_params == {}
    assert BuildSettings.make(ratio=1).to_json()["ratio"] == 1.0
    assert isinstance(BuildSettings.make(ratio=1).ratio, float)


def test_from_json_round_trips_and_checks_again():
    for s in (BuildSettings.make(), BuildSettings.make(method="none"),
              BuildSettings.make(method="am", ratio=0.1, quant="int8", group_size=128, ridge=0.1),
              BuildSettings.make(method="streaming", kv_dtype="bfloat16", chunk_size=16, zstd_level=19)):
        record = json.loads(json.dumps(s.to_json()))  # as read back from a manifest
        again = BuildSettings.from_json(record)
        assert again == s and hash(again) == hash(s) and again.to_json() == record
    old = BuildSettings.make().to_json()
    del old["kv_dtype"]  # records from before --kv-dtype
    assert BuildSettings.from_json(old).kv_dtype == "auto"
    good = BuildSettings.make().to_json()
    for bad, message in (([], "must be a dict"), ({**good, "ratio": 0}, r"ratio must be in \(0, 1\]"),
                         ({k: v for k, v in good.items() if k != "checksum"}, "lack checksum"),
                         ({**good, "quant": ["int4", 32]}, "quant must be"),
                         ({**good, "quant": ["int4", 32, "plain"]}, "quant must be"),
                         ({**good, "quant": ["int4", 48, "compact"]}, "group_size must be one of"),
                         ({**good, "options": {"ratio": 0.5}}, "options must be a dict of method options"),
                         ({**good, "options": {"colour": "red"}}, "bad parameters for method 'kvzip'")):
        with pytest.raises(InputError, match=message):
            BuildSettings.from_json(bad)


def test_settings_are_frozen_and_their_json_is_a_copy():
    s = BuildSettings.make(method="am", recent=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.ratio = 0.5
    record = s.to_json()
    record["options"]["recent"] = 9
    record["method_params"]["recent"] = 9
    assert s.options == {"recent": 4} and s.method_params["recent"] == 4
    kwargs = s.compress_kwargs()
    kwargs["recent"] = 9
    assert s.options == {"recent": 4}
    assert len({s, BuildSettings.make(method="am", recent=4)}) == 1  # hashable, equal by value


@pytest.mark.parametrize("kwargs,message", [
    (dict(ratio=0.0), r"ratio must be in \(0, 1\] \(the fraction of KV entries kept\), got 0.0"),
    (dict(ratio=1.5), r"ratio must be in \(0, 1\] \(the fraction of KV entries kept\), got 1.5"),
    (dict(ratio=True), r"ratio must be in \(0, 1\] \(the fraction of KV entries kept\), got True"),
    (dict(ratio=float("nan")), r"ratio must be in \(0, 1\]"),
    (dict(ratio="0.3"), r"got '0.3'"),
    (dict(chunk_size=0), "chunk_size must be a positive number of tokens, got 0"),
    (dict(chunk_size=True), "chunk_size must be a positive number of tokens, got True"),
    (dict(method="nope"), "unknown method 'nope'"),
    (dict(colour="red"), "bad parameters for method 'kvzip'"),
    (dict(quant="int2"), "unknown quantization 'int2'"),
    (dict(quant="int4", group_size=48), r"group_size must be one of \[32, 64, 128\], got 48"),
    (dict(zstd_level=23), "zstd_level must be 0"),
    (dict(checksum="md5"), "checksum must be one of"),
    (dict(kv_dtype="int8"), "unknown kv_dtype 'int8'; choose one of auto, float32, bfloat16, float16"),
])
def test_make_refuses_bad_settings_with_the_messages_of_before(kwargs, message):
    with pytest.raises(InputError, match=message):
        BuildSettings.make(**kwargs)


def test_the_shared_checks():
    check_ratio(1)
    check_ratio(0.3)
    check_chunk_size(1)
    check_quant("none", "unused")
    check_quant("int4", 64, head_dim=64)
    with pytest.raises(InputError, match="head_dim must be a multiple of 2"):
        check_quant("int4", 32, head_dim=63)
    with pytest.raises(InputError, match=r"ratio must be in \(0, 1\]"):  # the benchmark's grid checks with it too
        expand_grid(["kvzip"], [0.5, 2.0], ["none"])
    with pytest.raises(InputError, match=r"ratio must be in \(0, 1\]"):
        expand_grid(["kvzip"], ["0.5"], ["none"])


def test_the_library_build_takes_settings_or_their_arguments(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT[:120], encoding="utf-8")
    ctxs = discover_contexts([tmp_path / "a.txt"])
    with pytest.raises(InputError, match="BuildSettings"):
        plan_build(ctxs, tmp_path / "out", BuildSettings.make().to_json())
    model, tok = tiny_model("llama")
    settings = BuildSettings.make(ratio=0.5, chunk_size=64)
    with pytest.raises(InputError, match="either settings or ratio, not both"):
        build(ctxs, model, tok, out_dir=tmp_path / "out", settings=settings, ratio=0.5)
    (first,) = build(ctxs, model, tok, out_dir=tmp_path / "out", settings=settings)
    (again,) = build(ctxs, model, tok, out_dir=tmp_path / "out", ratio=0.5, chunk_size=64)
    assert (first.status, again.status) == ("built", "up_to_date")


def test_the_module_imports_without_torch():
    code = "import sys, kvpack.build_settings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_inert_parameters_are_recorded_at_their_defaults():
    """``--max-head-ratio`` caps only capped splits, and the ridge search replaces the fit's guards: settings that
    differ only there are the same build (and the same up-to-date pack); where they act, they differ."""
    def params(**options):
        return BuildSettings.make(method="am", **options).method_params

    plain = params()
    assert params(max_head_ratio=0.9) == plain
    assert params(value_bound=5.0, held_out_check=False) == plain
    assert params(max_head_ratio=0.9)["max_head_ratio"] == 0.75
    capped = params(budgets="global-capped", max_head_ratio=0.9)
    assert capped["max_head_ratio"] == 0.9
    assert capped != params(budgets="global-capped")
    unguarded = params(ridge_search=False, value_bound=5.0)
    assert unguarded["value_bound"] == 5.0
    # the self-study seed and answer count act only on sampled answers (the default); greedy, they are inert
    assert params(self_study_seed=3) != plain and params(self_study_samples=3) != plain
    greedy = params(self_study_temperature=0.0)
    assert params(self_study_temperature=0.0, self_study_seed=3, self_study_samples=3) == greedy
