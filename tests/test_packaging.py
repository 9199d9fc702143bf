"""pyproject.toml lists every folder the package needs (its packages are explicit, since ``kernels/`` is installed as
``kvpack.kernels``): a new subpackage or data folder missing from the list would be left out of a wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_and_kernels_is_kvpack_kernels():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {".".join(p.relative_to(ROOT).parts) for p in (ROOT / "kvpack").rglob("*")
               if p.is_dir() and p.name != "__pycache__" and any(f.is_file() for f in p.iterdir())}
    assert folders | {"kvpack", "kvpack.kernels"} == listed
    assert config["package-dir"] == {"kvpack.kernels": "kernels"}
    from kvpack import kernels

    assert Path(kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
