"""``tools/gpu_check.sh --dry-run``: the GPU script's stages run on CPU with a small shape, so it cannot break
unseen (the GPU run itself needs a lent H200 and is never part of the suite)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_every_section(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), KVPACK_TMP=str(tmp_path / "scratch"), PYTHON=sys.executable,
               OMP_NUM_THREADS="1")
    res = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    path = tmp_path / "out" / "gpu_check.md"
    assert path.exists(), res.stdout + res.stderr
    report = path.read_text()
    assert res.returncode == 0, res.stdout + res.stderr + report
    assert "kernel tests 0, decode benchmark 0, shape model 0, main job 0" in report
    assert re.search(r"\d+ tests? collected", report)  # the kernel tests import and collect
    assert re.search(r"\| packed-cache \| \d+ \|", report)  # the decode benchmark's packed-cache row
    for method in ("kvzip", "streaming"):  # the main job's rows: numbers in every column
        row = re.search(rf"^\| {method} \|(.*)\|$", report, re.M)
        assert row and all(re.fullmatch(r" [\d.]+x? ", c) for c in row.group(1).split("|")), report
