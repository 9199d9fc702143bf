"""``kvpack bench``: a failing task is marked in results.md and makes the command exit non-zero; the memory task's
subprocesses import the same kvpack from any working folder."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvpack.bench import runner
from kvpack.bench.speed import measure_memory
from kvpack.cli import cli


def test_a_failing_task_is_marked_and_the_exit_status_is_non_zero(tmp_path, monkeypatch):
    def broken_speed(*args, **kwargs):
        raise RuntimeError("speed broke\nsecond line")

    def memory_rows(lengths, *args, **kwargs):
        return [{"tokens": n, "error": "ModuleNotFoundError: no kvpack"} for n in lengths]

    monkeypatch.setattr(runner, "measure_speed", broken_speed)
    monkeypatch.setattr(runner, "measure_memory", memory_rows)
    out = tmp_path / "bench"
    res = CliRunner().invoke(cli, ["bench", "--quick", "--tasks", "continuation,speed,memory", "--no-plots",
                                   "--out", str(out)])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    assert res.stderr.strip().splitlines()[-1] == (
        "error: 2 bench task(s) failed (speed: RuntimeError: speed broke; memory: 1024 tokens: ModuleNotFoundError: "
        f"no kvpack; 2048 tokens: ModuleNotFoundError: no kvpack; 4096 tokens: ModuleNotFoundError: no kvpack); see "
        f"{out / 'results.md'}")
    md = (out / "results.md").read_text(encoding="utf-8")
    assert "## FAILED tasks" in md and "- **FAILED** `speed`: RuntimeError: speed broke" in md
    assert "- **FAILED** `memory`: 1024 tokens" in md
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert set(results["failures"]) == {"speed", "memory"}
    assert results["continuation"]["summary"]  # the task that works still ran and is reported


def test_memory_subprocess_works_from_a_folder_holding_a_kvpack_checkout(tmp_path, monkeypatch):
    shadow = tmp_path / "kvpack"  # what `python -m kvpack...` would import from this folder without -P
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the checkout folder, not the package')\n")
    monkeypatch.chdir(tmp_path)
    rows = measure_memory([256], "streaming", 0.5, chunk_size=128, threads=1)
    assert "error" not in rows[0], rows
    assert rows[0]["tokens"] == 256 and rows[0]["peak_bytes"] >= rows[0]["baseline_bytes"] > 0
