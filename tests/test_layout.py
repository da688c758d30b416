"""The package layout: the engine-free core (vase_sglang and its modules) imports neither SGLang
nor the tooling (vase_sglang.serving, vase_sglang.training); the tooling imports no SGLang (the
GPU image has none) and the launcher neither the tests nor the benchmarks; the old import paths
of the moved modules still work. Each check runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The old import paths of moved modules re-export them (and so import the tooling): not core.
SHIMS = {"models", "retention", "gpu_check"}
CORE = ["vase_sglang", "vase_sglang.ops",
        *sorted(f"vase_sglang.{p.stem}" for p in (ROOT / "vase_sglang").glob("*.py")
                if p.stem != "__init__" and p.stem not in SHIMS)]
TOOLING = ["vase_sglang.serving.launcher", "vase_sglang.serving.ports",
           "vase_sglang.serving.models", "vase_sglang.serving.tiny_model",
           "vase_sglang.serving.answers", "vase_sglang.serving.hf_reference",
           "vase_sglang.serving.gpu_check", "vase_sglang.training.retention"]


def _loaded_after_import(modules: list[str]) -> set[str]:
    """The modules loaded after importing `modules` in a fresh process where `import sglang`
    fails (a module that imports it without catching the error fails the import)."""
    code = ("import sys; sys.modules['sglang'] = None\n"
            + "".join(f"import {m}\n" for m in modules)
            + "print('\\n'.join(sorted(m for m, v in sys.modules.items() if v is not None)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(out.stdout.split())


def test_core_imports_neither_sglang_nor_the_tooling():
    assert {"vase_sglang.config", "vase_sglang.policies", "vase_sglang.gates"} <= set(CORE)
    loaded = _loaded_after_import(CORE)
    assert not {m for m in loaded if m == "sglang" or m.startswith("sglang.")}
    assert not {m for m in loaded if m.startswith(("vase_sglang.serving", "vase_sglang.training",
                                                   "vase_sglang_patches"))}


def test_tooling_imports_no_sglang_nor_the_tests_or_benchmarks():
    loaded = _loaded_after_import(TOOLING)
    assert not {m for m in loaded if m == "sglang" or m.startswith("sglang.")}
    assert not {m for m in loaded if m in ("servers", "conftest", "benchmarks")
                or m.startswith(("benchmarks.", "vase_sglang_patches"))}


@pytest.mark.parametrize("old, new, names", [
    ("vase_sglang.models", "vase_sglang.serving.models", ["fetch", "MODELS", "ModelFetchError",
                                                          "DEFAULT_MODEL", "cache_root", "main"]),
    ("vase_sglang.gpu_check", "vase_sglang.serving.gpu_check", ["main", "SECTIONS",
                                                                "score_tolerance"]),
    ("vase_sglang.retention", "vase_sglang.gates", ["GatesError", "load_gates", "save_gates",
                                                    "RetentionGates", "recording_log_beta",
                                                    "read_metadata", "TENSORS"]),
    ("vase_sglang.retention", "vase_sglang.training.retention", ["train", "TrainConfig", "losses",
                                                                 "install_training_attention",
                                                                 "capacity_loss", "main"]),
])
def test_old_import_paths_are_the_moved_objects(old, new, names):
    import importlib

    old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_mod, name) is getattr(new_mod, name), (old, name)


# -- no import cycles ---------------------------------------------------------------------------

PACKAGES = {"vase_sglang": ROOT / "vase_sglang", "vase_sglang_patches": ROOT / "patches"}


def _import_graph(packages: dict) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports, at module level or inside a function
    (a lazy import is still a dependency), from the source; imports under `if TYPE_CHECKING:`
    are annotations only and left out, and so are the packages' __init__ modules (they
    re-export their submodules, so every submodule reaches them)."""
    import ast

    modules = {}
    for package, base in packages.items():
        for path in base.rglob("*.py"):
            parts = [package, *path.relative_to(base).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                deps.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                            for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name
                       and modules[d].name != "__init__.py"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    """No import cycle within the core or the hooks: runtime <-> state, memory <-> model_runner
    and config <-> policies <-> stream_select came back once (issue 58) as imports inside
    functions; a lower module must not reach up, even lazily."""
    graph = _import_graph(PACKAGES)
    assert "vase_sglang_patches.state" in graph["vase_sglang_patches.ring"]
    assert "vase_sglang_patches.settings" in graph["vase_sglang_patches.request_control"]
    assert "vase_sglang.config" in graph["vase_sglang.policies"]
    assert "vase_sglang.plan" in graph["vase_sglang_patches.memory"]  # a lazy import counts
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_lazy_cycle(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from . import a\n")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from .a import x\n")
    (tmp_path / "pkg" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    graph = _import_graph({"pkg": tmp_path / "pkg"})
    assert _cycles(graph) == [["pkg.a", "pkg.b"]] and graph["pkg.c"] == set()
