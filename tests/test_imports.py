"""kvpack's imports: no cycle between its modules (imports inside functions included), read from the source with
``ast`` (nothing is imported), and commands that read only headers start without torch."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Source folder -> the package it is installed as (``kernels/`` is ``kvpack.kernels``: pyproject.toml).
PACKAGES = {ROOT / "kvpack": "kvpack", ROOT / "kernels": "kvpack.kernels"}


def module_files() -> dict[str, Path]:
    """``{module name: file}`` of every module of the package (``__init__.py`` names the package itself)."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: the kvpack modules it imports}``: every ``import`` and ``from ... import`` anywhere in its file
    (module level, functions, ``TYPE_CHECKING`` blocks), relative imports resolved; ``from M import x`` counts ``M.x``
    when that is a module, else ``M``. The implicit import of a parent package is not counted."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in files]
                found.update(subs)
                if len(subs) < len(node.names):
                    found.add(target)
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _describe(part: list[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in part for b in sorted(graph[a]) if b in part]
    return f"{', '.join(part)} ({'; '.join(edges)})"


def test_the_graph_reader_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "kvpack.methods.params" in graph["kvpack.methods.base"]  # from .params import ...
    assert "kvpack.heads" in graph["kvpack.methods.kvzip_head"]  # the method reads head files, never the reverse
    assert not graph["kvpack.heads"] & {"kvpack.methods", "kvpack.methods.kvzip_head"}
    assert "kvpack.model" in graph["kvpack.cli"]  # inside the commands' functions
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


_PLAIN = re.compile(r"(?<!from kvpack )\bimport kernels\b|\bfrom kernels\b")


def test_kernels_have_one_name():
    """``kernels/`` is installed as ``kvpack.kernels``; importing it as plain ``kernels`` too would load its files
    twice, under two names whose import-time flags (``HAS_TRITON``) could disagree."""
    plain = []
    for folder in (ROOT / "kvpack", ROOT / "kernels", ROOT / "tests", ROOT / "tools"):
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                plain += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "kernels"]
            plain += [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)  # code run in a subprocess
                      if path.name != "test_imports.py" and isinstance(node, ast.Constant)
                      and isinstance(node.value, str) and _PLAIN.search(node.value)]
    assert not plain, f"import kvpack.kernels, not kernels: {plain}"


def test_no_import_cycle():
    """A module never imports, even inside a function, a module that imports it back (directly or not): the
    package reads bottom-up, from the format to the CLI."""
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(_describe(p, graph) for p in found)


# ---------------------------------------------------------------------------------------------------------------
# start-up


def _seconds(args: list[str], env: dict, tries: int = 3) -> float:
    """Best of ``tries`` wall times of ``python args`` (the minimum is the least disturbed by other load)."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *args], env=env, capture_output=True, timeout=120)
        best = min(best, time.perf_counter() - t0)
    return best


def test_header_constants_agree_with_torch():
    """The torch-free element sizes the header parser uses are the torch dtypes' (made on first use)."""
    import torch

    from kvpack import constants as C

    assert {code: dtype.itemsize for code, dtype in C.DTYPE_BY_CODE.items()} == C.ITEMSIZE_BY_CODE
    assert C.CODE_BY_DTYPE[torch.bfloat16] == "BF16" and C.DTYPE_BY_CODE["F16"] is torch.float16


@pytest.fixture(scope="module")
def baseline() -> tuple[dict, float]:
    """The environment of the timed runs and their time budget: 1.5 s over a bare interpreter, or half of what
    importing torch alone takes right now if that is more (the machine may be loaded: both scale with it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return env, max(_seconds(["-c", "pass"], env) + 1.5, 0.5 * _seconds(["-c", "import torch"], env, tries=2))


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """A folder with one small pack (built by the API in this process: the commands below must not need torch)."""
    import kvpack

    from .tiny import TEXT, tiny_model

    folder = tmp_path_factory.mktemp("startup")
    model, tok = tiny_model("llama")
    kvpack.save(kvpack.compress(model, tok, TEXT, ratio=0.5), folder / "doc.kvpack")
    return folder


@pytest.mark.parametrize("command", [["--help"], ["build", "--help"], ["ls", "{dir}"], ["verify", "{dir}/doc.kvpack"],
                                     ["ls", "{dir}", "--json"], ["verify", "{dir}/doc.kvpack", "--json"],
                                     ["info", "{dir}/doc.kvpack"], ["info", "{dir}/doc.kvpack", "--json"],
                                     ["info", "{dir}"]])
def test_header_commands_start_without_torch(packs, baseline, command):
    """``kvpack --help``, ``ls``, ``verify`` (without ``--model``) and ``info`` read only headers, checksums and the
    small index tensors (numpy): they must not import torch or transformers (about 3 s of start-up), and finish
    within ``baseline``'s budget (best of three runs; on an idle 2-core machine they take 0.2-0.4 s, torch's import
    alone 1.1 s)."""
    args = [a.replace("{dir}", str(packs)) for a in command]
    env, budget = baseline
    probe = ("import runpy, sys\nsys.argv = ['kvpack', *sys.argv[1:]]\ntry:\n    runpy.run_module('kvpack', "
             "run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
             "print('\\nIMPORTED', *sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
             "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, *args], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("IMPORTED"), proc.stdout[-300:]
    took = _seconds(["-m", "kvpack", *args], env)
    assert took < budget, f"kvpack {' '.join(command)} took {took:.2f} s, over the budget of {budget:.2f} s"


def test_tools_import_names_that_exist():
    """Every ``from kvpack... import name`` in ``tools/*.py`` names something the package has (a rename in the
    package once broke ``tools/bench_am.py`` with an ``ImportError`` that no test saw)."""
    import importlib

    missing = []
    for path in sorted((ROOT / "tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "kvpack":
                module = importlib.import_module(node.module)
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and not _is_submodule(module, a.name)]
    assert not missing, missing


def _is_submodule(module, name: str) -> bool:
    """Whether ``name`` is a submodule of the package ``module`` (``from kvpack import tasks``)."""
    import importlib.util

    return hasattr(module, "__path__") and importlib.util.find_spec(f"{module.__name__}.{name}") is not None


def test_bench_am_fit_side_names_are_parameters():
    """``tools/bench_am.py`` shares one scoring pass between AM variants that differ only in ``FIT_SIDE``
    parameters; a name there that is no AM parameter (a rename) would make two variants share a pass they should
    not, and a parameter read by ``score()`` must not be there (the self-study and reference settings)."""
    import dataclasses
    import importlib.util

    from kvpack.methods.params import AttentionMatchingParams, KVzipParams

    spec = importlib.util.spec_from_file_location("bench_am", ROOT / "tools" / "bench_am.py")
    bench_am = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_am)
    am_fields = {f.name for f in dataclasses.fields(AttentionMatchingParams)}
    assert bench_am.FIT_SIDE <= am_fields, bench_am.FIT_SIDE - am_fields
    assert bench_am.KVZIP_SELECT_SIDE <= {f.name for f in dataclasses.fields(KVzipParams)}
    read_by_score = {"reference", "queries", "on_policy", "score_queries", "ridge_search", "continue_tokens"}
    read_by_score |= {f for f in am_fields if f.startswith("self_study_")}
    assert not bench_am.FIT_SIDE & read_by_score


def test_bench_am_layer_splits():
    """``tools/bench_am.py``'s ``adakvF`` gives every layer the same budget (Ada-KV, arXiv 2407.11550) with each head
    at least ``F x`` the layer's even per-head share and the method's recent tokens kept; ``lfloorF`` keeps the
    exact total with every layer at least ``F x`` the even per-layer share."""
    import importlib.util
    import types

    import torch

    spec = importlib.util.spec_from_file_location("bench_am", ROOT / "tools" / "bench_am.py")
    bench_am = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_am)
    torch.manual_seed(0)
    scores = torch.rand(4, 3, 100)
    scores[0] += 10  # layer 0 would take nearly everything by a global top-k
    scorer = types.SimpleNamespace(recent=4)
    total = round(0.1 * scores.numel())  # 120
    keep = bench_am.split_budget(scorer, scores, 0.1, None, "adakv0.5")
    assert int(keep.sum()) == total
    assert keep.sum(dim=(1, 2)).tolist() == [30, 30, 30, 30]
    assert int(keep.sum(dim=2).min()) >= 5  # 0.5 x 30 / 3
    assert bool(keep[..., -4:].all())
    keep = bench_am.split_budget(scorer, scores, 0.1, None, "lfloor0.5")
    assert int(keep.sum()) == total
    assert keep.sum(dim=(1, 2))[1:].tolist() == [15, 15, 15]  # the floors; layer 0 takes the rest by score
    assert bool(keep[1:, :, -4:].all())  # the recent tokens come first within each layer's floor
    for bad in ("lfloor2", "adakvx", "floor-0.5"):  # a share outside [0, 1] would keep more than asked
        with pytest.raises(SystemExit, match="share in"):
            bench_am.split_budget(scorer, scores, 0.1, None, bad)
