#!/usr/bin/env python
"""Coverage-guided fuzzing of the ``.kvpack`` reader with atheris (optional: ``pip install atheris``; not run in CI).

Every input is read as a file's bytes by ``read_header``, ``verify`` and ``load_pack``; any exception other than a
``KvpackError`` (an untyped crash), or ``verify`` and ``load_pack`` disagreeing, aborts the run with the input saved
by libFuzzer. Seed it with the golden and hostile files:

    python tools/fuzz_atheris.py -max_len=65536 -timeout=5 -rss_limit_mb=1024 runs/atheris_corpus format/golden tests/hostile
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import atheris  # noqa: E402

with atheris.instrument_imports():
    from kvpack.errors import KvpackError
    from kvpack.fileformat import load_pack, read_header, verify


def _outcome(reader, data: bytes) -> str:
    try:
        reader(data)
        return "ok"
    except KvpackError as exc:
        return type(exc).__name__


def test_one_input(data: bytes) -> None:
    """The fuzz target: typed errors only, and ``verify`` agrees with ``load_pack``."""
    _outcome(read_header, data)
    a, b = _outcome(verify, data), _outcome(load_pack, data)
    if a != b:
        raise AssertionError(f"verify says {a}, load_pack {b}")


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
