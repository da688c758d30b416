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
