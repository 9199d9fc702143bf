"""The golden end-to-end path on the embedded model: build examples/ with the CLI, ask a fact stated deep
inside a document, and get it back from the compressed file (KVzip, keep 0.3)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from kvpack.cli import cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_build_examples_and_ask_a_deep_fact(tmp_path):
    runner = CliRunner()
    out = tmp_path / "packs"
    result = runner.invoke(cli, ["build", str(EXAMPLES / "contextvars.md"), "--method", "kvzip", "--ratio", "0.3",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    pack = out / "contextvars.kvpack"
    assert pack.exists()
    result = runner.invoke(cli, ["ask", str(pack), "What is the secret code of Maria?"])
    assert result.exit_code == 0, result.output
    assert "73914" in result.output
