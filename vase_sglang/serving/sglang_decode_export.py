"""Exports SGLang's Triton decode-attention kernels into a module that runs without SGLang.

    python -m vase_sglang.serving.sglang_decode_export            (writes GENERATED)
    python -m vase_sglang.serving.sglang_decode_export --check    (exit 1 if GENERATED differs)

The GPU image of `scripts/gpu_check.sh` has torch and Triton but no SGLang, and SGLang's
`sglang/kernels/ops/attention/decode_attention.py` cannot be imported there (it imports
`sglang.srt.environ` and `sglang.srt.utils`, which need many packages). This exporter, run where
SGLang is installed, reads that file's source (never importing SGLang) and writes
`vase_sglang/serving/sglang_decode_attention.py`:

  * the file's Apache-2.0 header, then a note of what was done: the SGLang version, the files'
    SHA-256, this command;
  * the file's own imports from the standard library, torch and Triton, verbatim;
  * small shims, marked as ours, for the names it imports from SGLang (`is_hip()` and the AMD
    probes answer False; `envs` raises if read; `unpack_aux_tensors` is copied verbatim from
    `score_mod.py`) and for the Lean-attention path (HIP only; not exported, raises if called);
  * every top-level statement that `decode_attention_fwd` reaches by name (the closure over
    the module's globals), **verbatim** (source lines, decorators and the comment block just
    above each), in the file's order: `decode_attention_fwd` -> `decode_attention_fwd_grouped`
    (`_fwd_grouped_kernel_stage1`, GQA) or `decode_attention_fwd_normal` (`_fwd_kernel_stage1`,
    MHA) -> `_fwd_kernel_stage2`, with their launch wrappers and constants.

So the exported `decode_attention_fwd` is SGLang's, called as SGLang's Triton backend calls it,
on CUDA (NVIDIA) or in Triton's interpreter. tests/test_sglang_decode_export.py checks that the
committed file equals a fresh export from the installed SGLang, and that it gives bit for bit
the outputs of SGLang's own `decode_attention_fwd` in the interpreter (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

GENERATED = Path(__file__).resolve().with_name("sglang_decode_attention.py")
SOURCE = ("kernels", "ops", "attention", "decode_attention.py")  # under sglang's package folder
SCORE_MOD = ("kernels", "ops", "attention", "score_mod.py")
ROOTS = ("decode_attention_fwd",)
# Names of the source file reached only when _is_hip (the Lean-attention path): shims raise.
NOT_EXPORTED = ("_lean_head_dim_ok", "_should_use_lean_decode", "_lean_decode_launch_params",
                "_decode_lean_attention_fwd")
# Names imported from SGLang: copied verbatim from their file, or shimmed.
COPIED_IMPORTS = {"unpack_aux_tensors": SCORE_MOD}
SHIMMED = {"is_hip", "is_gfx95_supported", "is_gfx1250_supported", "get_device_core_count", "envs"}
SHIMS = '''\
# ---- shims (vase_sglang, not SGLang code) for the names decode_attention.py imports from SGLang.
# This module runs on CUDA (NVIDIA) or in Triton's interpreter, never on HIP: the AMD probes
# answer False, so every branch that would read `envs`, count cores or take the Lean path is off.


def is_hip() -> bool:  # sglang.srt.utils.is_hip
    return False


def is_gfx95_supported() -> bool:  # sglang.srt.utils: an AMD gfx950 probe
    return False


def is_gfx1250_supported() -> bool:  # sglang.srt.utils: an AMD gfx1250 probe
    return False


def get_device_core_count(device_id: int = 0) -> int:  # sglang.srt.utils; read on HIP only
    return torch.cuda.get_device_properties(device_id).multi_processor_count


class _NoEnvs:
    """sglang.srt.environ.envs: only the HIP paths read it."""

    def __getattr__(self, name):
        raise RuntimeError(f"envs.{name}: an SGLang setting read on HIP only; this export "
                           "(vase_sglang.serving.sglang_decode_export) runs on CUDA")


envs = _NoEnvs()


def _hip_only(name):
    def shim(*args, **kwargs):
        raise RuntimeError(f"{name}: SGLang's Lean attention (HIP only) is not exported")

    shim.__name__ = name
    return shim


'''


def sglang_folder() -> Path:
    """The installed sglang package's folder, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed: the export reads its source")
    return Path(next(iter(spec.submodule_search_locations)))


def _header(text: str) -> list[str]:
    """The file's leading comment block (its license header)."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _defined(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


def _segment(lines: list[str], stmt: ast.stmt) -> str:
    """The statement's source lines, with its decorators and the comment block right above."""
    start = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])]) - 1
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    return "\n".join(lines[start: stmt.end_lineno]) + "\n"


def _closure(tree: ast.Module, roots, stop) -> tuple[list[ast.stmt], set[str]]:
    """The top-level statements that the roots reach by name (not through `stop`), in file
    order, and the names they use that no top-level statement of the file defines."""
    defs: dict[str, ast.stmt] = {}
    for stmt in tree.body:
        for name in _defined(stmt):
            defs.setdefault(name, stmt)
    wanted, todo, free = set(), list(roots), set()
    while todo:
        name = todo.pop()
        if name in stop:
            free.add(name)
            continue
        stmt = defs.get(name)
        if stmt is None:
            free.add(name)
            continue
        if id(stmt) in wanted:
            continue
        wanted.add(id(stmt))
        todo.extend(_names(stmt))
    return [s for s in tree.body if id(s) in wanted], free


def _function(text: str, name: str) -> str:
    tree = ast.parse(text)
    lines = text.splitlines()
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
            return _segment(lines, stmt)
    raise RuntimeError(f"{name} is not a top-level function of the source")


def export(folder: Path | None = None) -> str:
    """The generated module's text, from the SGLang installed in `folder` (default: found)."""
    folder = folder or sglang_folder()
    path = folder.joinpath(*SOURCE)
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    imported_from_sglang, kept_imports = set(), []
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("sglang"):
            imported_from_sglang |= {a.asname or a.name for a in stmt.names}
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            kept_imports.append(_segment(lines, stmt).rstrip("\n").lstrip("\n"))
    body, free = _closure(tree, ROOTS, set(NOT_EXPORTED))
    # A name the closure uses and that decode_attention.py imports from SGLang must be shimmed
    # or copied; any other name it does not define is a builtin, a module or a local.
    missing = (free & imported_from_sglang) - SHIMMED - set(COPIED_IMPORTS)
    if missing:
        raise RuntimeError(f"decode_attention.py now uses SGLang names this export does not "
                           f"provide: {sorted(missing)}; extend SHIMS / COPIED_IMPORTS")
    copied = []
    for name, where in COPIED_IMPORTS.items():
        source = folder.joinpath(*where)
        copied.append(f"# verbatim from sglang/{'/'.join(where)}\n"
                      + _function(source.read_text(), name))
    hashes = {"/".join(p): hashlib.sha256(folder.joinpath(*p).read_bytes()).hexdigest()
              for p in (SOURCE, SCORE_MOD)}
    version = importlib.metadata.version("sglang")
    exported = [n for s in body for n in _defined(s)]
    note = [
        '"""SGLang\'s Triton decode attention (decode_attention_fwd, its grouped and MHA stage-1',
        "kernels and stage 2), exported to run without SGLang: GENERATED, do not edit.",
        "",
        f"    python -m vase_sglang.serving.sglang_decode_export     (SGLang {version})",
        "",
        "Modified from SGLang's files (Apache-2.0, header above): the top-level statements that",
        "decode_attention_fwd reaches, copied verbatim in the file's order; its imports from",
        "SGLang replaced by shims (is_hip() is False: CUDA or Triton's interpreter only) or copied",
        "verbatim (unpack_aux_tensors); the Lean-attention path (HIP only) left out.",
        "",
    ]
    note += [f"sha256 {h}  {p.rsplit('/', 1)[-1]}" for p, h in hashes.items()]
    note += ["", "Exported: " + ", ".join(exported) + ".",
             "Not exported (HIP only; raise if called): " + ", ".join(NOT_EXPORTED) + ".",
             '"""']
    # wrap the long "Exported" line at 100 columns
    wrapped = []
    for line in note:
        while len(line) > 100:
            cut = line.rfind(" ", 0, 100)
            wrapped.append(line[:cut])
            line = line[cut + 1:]
        wrapped.append(line)
    parts = ["\n".join(_header(text)), "\n".join(wrapped), "\n".join(kept_imports), SHIMS.rstrip()]
    parts.append("\n".join(f"{n} = _hip_only({n!r})" for n in NOT_EXPORTED))
    parts += [c.rstrip() for c in copied]
    parts += [_segment(lines, s).rstrip() for s in body]
    return "\n\n\n".join(p.strip("\n") for p in parts) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vase_sglang.serving.sglang_decode_export",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=GENERATED)
    p.add_argument("--check", action="store_true",
                   help="exit 1 if the file differs from a fresh export (writes nothing)")
    args = p.parse_args(argv)
    text = export()
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from a fresh export'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
