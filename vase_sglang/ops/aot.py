"""Ahead-of-time compile check of every Triton kernel for real GPU targets, on a machine with no GPU.

Triton takes its target from the active driver. `_FixedTargetDriver` reports a fixed
`GPUTarget("cuda", arch, 32)`, device 0 and stream 0, so the project's own launch wrappers
(`value_range_triton`, ...) specialise and compile their kernels exactly as they would on that GPU,
with CPU tensors as arguments; only the launch is replaced by a no-op (`_no_launch`). From each
compiled kernel we read:

  shared     bytes of dynamic shared memory (`metadata.shared`), against the architecture's
             opt-in per-block limit (what Triton itself checks when it loads the kernel on a GPU)
  num_warps  from the metadata
  registers  per thread, and the stack frame, from the cubin (`cuobjdump --dump-resource-usage`,
             shipped with the Triton wheel): the binary that would run, not a re-compile
  spills     local-memory instructions (STL/LDL) in the cubin's SASS: Triton kernels have no
             local arrays, so any local access is a register spill

A kernel fails the check when it could not launch on that architecture: shared memory above the
limit, more than 255 registers per thread or 64K per block (Triton's OutOfResources at load).
Spills are reported; `--strict` fails on them too, and the CI test (tests/test_triton_compile.py)
runs with --strict: since the scoring kernels were moved to tensor cores with the head dim tiled
(docs/gpu.md), no kernel spills at any arch x dtype x head dim compiled here, and a spill is a
regression (a spilling kernel still runs and computes the same result, but its local-memory
traffic competes with the K/V reads these kernels exist to stream).

The real compiler must be in use: a process with TRITON_INTERPRET=1 (the tests' conftest sets it)
decorates kernels as interpreted functions at import, so run this in a fresh process:

    python -m vase_sglang.ops.aot --json results/triton_compile.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

ARCHS = (80, 90, 100)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}
# --kv-cache-dtype fp8_*: K/V are stored in 8 bits, the query ring in the model's dtype.
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Triton has e4m3 (fp8e4nv) from sm_89 on: below it the server refuses fp8_e4m3 with the Triton
# kernels (patches/model_runner.check_fp8_kernels), so the check does not compile it there.
MIN_ARCH = {"fp8e4m3": 89}


def served_on(arch: int, dtype: str) -> bool:
    """Whether the server runs the kernels for K/V of `dtype` on sm_`arch`."""
    return arch >= MIN_ARCH.get(dtype, 0)
HEAD_DIMS = (64, 128, 256)

# cudaDevAttrMaxSharedMemoryPerBlockOptin: A100 163 KiB, H100/H200 and B200 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
MAX_REGS_PER_THREAD = 255
MAX_REGS_PER_BLOCK = 64 * 1024

# Shapes of one eviction step, small enough for CPU tensors. The candidate count is odd so that
# the length arguments take Triton's general (not divisible-by-16) specialisation.
BATCH, LAYERS, Q_HEADS, KV_HEADS, WINDOW, CANDIDATES, RANK = 2, 2, 32, 8, 64, 1003, 20


@dataclass
class KernelReport:
    wrapper: str
    kernel: str
    arch: int
    dtype: str
    head_dim: int
    num_warps: int
    num_stages: int
    shared: int
    shared_limit: int
    registers: int
    stack_bytes: int
    spill_instructions: int
    problems: list[str]
    warnings: list[str]
    wrapper_seconds: float  # the wrapper call: compiling its kernels, or a cache lookup


# ----------------------------------------------------------------------------- the launch wrappers


def _kv(dtype, d, n=CANDIDATES):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, LAYERS, KV_HEADS, n, d, generator=gen).to(dtype)


def _run_value_range(dtype, d):
    from vase_sglang.ops.value_range import value_range_triton

    value_range_triton(_kv(dtype, d))


def _run_window_attention(dtype, d, **options):
    from vase_sglang.ops.window_attention import window_attention_triton

    # The runtime hands the ring's queries as a permuted view [B, L, H_q, W, D].
    q_dtype = torch.bfloat16 if dtype in FP8 else dtype
    queries = torch.randn(LAYERS, BATCH, WINDOW, Q_HEADS, d).to(q_dtype).permute(1, 0, 3, 2, 4)
    window_attention_triton(queries, _kv(dtype, d), **options)  # other options: their defaults


def _window_attention_has_softcap() -> bool:
    """The soft-capped logits (Gemma-2-like models) are a separate specialisation (SOFTCAP is a
    constexpr) where the wrapper takes a `softcap`."""
    import inspect

    from vase_sglang.ops.window_attention import window_attention_triton

    return "softcap" in inspect.signature(window_attention_triton).parameters


def _run_cur_leverage(dtype, d):
    from vase_sglang.ops.cur_leverage import cur_leverage_triton

    projection = torch.randn(BATCH, LAYERS, d, RANK)  # float32, as the policies draw it
    cur_leverage_triton(_kv(dtype, d), _kv(dtype, d), projection)


def _run_compact(dtype, d):
    from vase_sglang.ops.compact import compact_kv_triton_

    n, kept = CANDIDATES, CANDIDATES - 500
    slots_per_layer = BATCH * (n + WINDOW) + 1
    k_bufs = [torch.zeros(slots_per_layer, KV_HEADS, d, dtype=dtype) for _ in range(LAYERS)]
    v_bufs = [torch.zeros(slots_per_layer, KV_HEADS, d, dtype=dtype) for _ in range(LAYERS)]
    row_slots = 1 + torch.arange(BATCH * (n + WINDOW)).view(BATCH, n + WINDOW)
    keep = torch.arange(kept).expand(BATCH, LAYERS, KV_HEADS, kept).contiguous()
    compact_kv_triton_(k_bufs, v_bufs, row_slots[:, :n], keep)  # slots: a [B, n] view, as served


def _run_cell_attention(dtype, d, **options):
    from vase_sglang.ops.cell_attention import cell_attention_triton

    # A request's K older slots as L·K·H cells, owned unequally (a random permutation cut into
    # L·H segments); K odd, so the cell counts take the general specialisation.
    gen = torch.Generator().manual_seed(0)
    older = 37
    cells = LAYERS * older * KV_HEADS
    slots_per_layer = BATCH * older + 1
    k_bufs = [torch.zeros(slots_per_layer, KV_HEADS, d, dtype=dtype) for _ in range(LAYERS)]
    v_bufs = [torch.zeros(slots_per_layer, KV_HEADS, d, dtype=dtype) for _ in range(LAYERS)]
    q_dtype = torch.bfloat16 if dtype in FP8 else dtype
    q = torch.randn(BATCH, Q_HEADS, d, generator=gen).to(q_dtype)
    older_slots = 1 + torch.arange(BATCH * older).view(BATCH, older)
    order = torch.stack([torch.randperm(cells, generator=gen) for _ in range(BATCH)])
    cuts = torch.randint(0, cells + 1, (BATCH, LAYERS * KV_HEADS - 1), generator=gen).sort().values
    offsets = torch.cat([torch.zeros(BATCH, 1, dtype=torch.int64), cuts,
                         torch.full((BATCH, 1), cells)], 1)
    cell_attention_triton(q, k_bufs, v_bufs, older_slots, order, offsets, 1, d ** -0.5, **options)


WRAPPERS: dict[str, Callable[[torch.dtype, int], None]] = {
    "value_range_triton": _run_value_range,
    "window_attention_triton": _run_window_attention,
    "cur_leverage_triton": _run_cur_leverage,
    "compact_kv_triton_": _run_compact,
    "cell_attention_triton": _run_cell_attention,
    "cell_attention_triton+softcap": functools.partial(_run_cell_attention, softcap=30.0),
}
if _window_attention_has_softcap():
    WRAPPERS["window_attention_triton+softcap"] = functools.partial(_run_window_attention,
                                                                   softcap=50.0)


KERNEL_MODULES = ("cell_attention", "compact", "cur_leverage", "value_range", "window_attention")


def _jit_functions() -> list:
    """Every @triton.jit function of the kernel modules (their per-device caches hold the target)."""
    import importlib

    import triton

    found = []
    for name in KERNEL_MODULES:
        # import_module, not `from vase_sglang.ops import ...`: the package's functions
        # value_range, window_attention and cur_leverage shadow the submodules of those names.
        module = importlib.import_module(f"vase_sglang.ops.{name}")
        kernels = [obj for obj in vars(module).values()
                   if isinstance(obj, triton.runtime.jit.JITFunction)]
        if not kernels:
            raise RuntimeError(f"vase_sglang.ops.{name} defines no compilable @triton.jit kernel "
                               "(TRITON_INTERPRET=1 at import makes them interpreted functions: "
                               "run the compile check in a fresh process)")
        found += kernels
    return found


# ------------------------------------------------------------------------ a driver with no device


def _fixed_target_driver(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class _FixedTargetDriver(DriverBase):
        """Just what JITFunction.run and compile() ask of a driver: the target, device, stream."""

        def __init__(self):
            self.target = GPUTarget("cuda", arch, 32)

        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("no launcher is built")

        def get_current_target(self):
            return self.target

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    return _FixedTargetDriver()


_LAUNCH_ATTRS = ("run", "_init_handles", "launch_metadata")


@contextlib.contextmanager
def compile_for(arch: int) -> Iterator[list]:
    """Within the block, Triton launches compile for sm_`arch` and do not run; yields the list of
    CompiledKernels launched, in launch order."""
    import triton
    from triton.compiler.compiler import CompiledKernel

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 in this process: kernels would be interpreted; "
                           "run the compile check in a fresh process without it")
    kernels = _jit_functions()
    launched: list = []

    def _no_launch(kernel):  # replaces the launcher and module loading (CompiledKernel.run)
        launched.append(kernel)
        return lambda *args, **kwargs: None

    drivers = triton.runtime.driver
    saved_driver = drivers._active
    saved = {name: CompiledKernel.__dict__[name] for name in _LAUNCH_ATTRS}
    drivers.set_active(_fixed_target_driver(arch))
    # JITFunction caches (target, backend) per device index, and the device is 0 for every arch.
    for fn in kernels:
        fn.device_caches.clear()
    # Everything that would load the cubin or build the launcher: run (the launcher property),
    # _init_handles (module loading) and launch_metadata (loads handles when a launch hook is set).
    CompiledKernel.run = property(_no_launch)
    CompiledKernel._init_handles = lambda kernel: None
    CompiledKernel.launch_metadata = lambda kernel, *args: None
    try:
        yield launched
    finally:
        for name, attr in saved.items():
            setattr(CompiledKernel, name, attr)
        drivers._active = saved_driver  # no CUDA driver here: reset_active() would raise
        for fn in kernels:
            fn.device_caches.clear()


# --------------------------------------------------------------------------- reading the binary


def _tool(name: str) -> str:
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def cubin_resources(cubin: bytes) -> dict:
    """Registers and stack bytes per thread, and local-memory instructions, of a one-kernel cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = _run_tool("cuobjdump", "--dump-resource-usage", f.name)
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
        if found is None:
            raise RuntimeError(f"cuobjdump printed no resource usage:\n{usage}")
        registers, stack, local = map(int, found.groups())
        spills = 0
        if stack or local:  # without any local memory there is nothing to spill to: skip the
            sass = _run_tool("cuobjdump", "--dump-sass", f.name)  # disassembly (0.5 s a kernel)
            spills = len(re.findall(r"\b(?:STL|LDL)\b", sass))
    return {"registers": registers, "stack_bytes": stack + local, "spill_instructions": spills}


def _run_tool(name: str, *args: str) -> str:
    return subprocess.run([_tool(name), *args], check=True, capture_output=True, text=True).stdout


def problems_of(report: KernelReport) -> list[str]:
    """What would stop the kernel from launching on that architecture (Triton's OutOfResources)."""
    found = []
    if report.shared > report.shared_limit:
        found.append(f"shared memory {report.shared} B > {report.shared_limit} B on sm_{report.arch}")
    if report.registers > MAX_REGS_PER_THREAD:
        found.append(f"{report.registers} registers/thread > {MAX_REGS_PER_THREAD}")
    if report.registers * report.num_warps * 32 > MAX_REGS_PER_BLOCK:
        found.append(f"{report.registers} registers x {report.num_warps * 32} threads > 64K/block")
    return found


def warnings_of(report: KernelReport) -> list[str]:
    """What runs, but slower than it should: register spills to local memory."""
    if report.spill_instructions:
        return [f"spills: {report.spill_instructions} local loads/stores, "
                f"{report.stack_bytes} B stack per thread"]
    return []


def _report(wrapper, kernel, arch, dtype, d, seconds) -> KernelReport:
    meta = kernel.metadata
    if meta.target.arch != arch:  # a kernel cached for another target would report wrong figures
        raise RuntimeError(f"{kernel.name} was compiled for sm_{meta.target.arch}, not sm_{arch}")
    r = KernelReport(
        wrapper=wrapper, kernel=kernel.name, arch=arch, dtype=dtype, head_dim=d,
        num_warps=meta.num_warps, num_stages=meta.num_stages, shared=meta.shared,
        shared_limit=SHARED_LIMIT[arch], problems=[], warnings=[], wrapper_seconds=seconds,
        **cubin_resources(kernel.asm["cubin"]),
    )
    r.problems, r.warnings = problems_of(r), warnings_of(r)
    return r


def compile_report(wrappers=tuple(WRAPPERS), archs=ARCHS, dtypes=tuple(DTYPES),
                   head_dims=HEAD_DIMS) -> list[KernelReport]:
    """One report per kernel launched by each named wrapper, for every arch x dtype x head dim."""
    reports = []
    for arch in archs:
        with compile_for(arch) as launched:
            for dtype in filter(functools.partial(served_on, arch), dtypes):
                for d in head_dims:
                    for name in wrappers:
                        launched.clear()
                        start = time.perf_counter()
                        WRAPPERS[name](DTYPES[dtype], d)
                        seconds = time.perf_counter() - start
                        if not launched:
                            raise RuntimeError(f"{name} launched no kernel for {dtype}, D={d}")
                        reports.extend(_report(name, k, arch, dtype, d, seconds) for k in launched)
    return reports


def _compile_one_arch(arch, wrappers, dtypes, head_dims):
    torch.set_num_threads(1)
    return compile_report(wrappers, (arch,), dtypes, head_dims)


def compile_report_parallel(wrappers, archs, dtypes, head_dims, jobs: int) -> list[KernelReport]:
    """compile_report with one process per architecture (compilation is single-threaded)."""
    if jobs <= 1 or len(archs) == 1:
        return compile_report(wrappers, archs, dtypes, head_dims)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: a fresh interpreter per worker, like the CLI's own (no inherited Triton state).
    with ProcessPoolExecutor(min(jobs, len(archs)), multiprocessing.get_context("spawn")) as pool:
        parts = pool.map(_compile_one_arch, archs, *([x] * len(archs) for x in
                                                     (wrappers, dtypes, head_dims)))
        return [r for part in parts for r in part]


# ------------------------------------------------------------------------------------ the CLI


def format_table(reports: list[KernelReport]) -> str:
    head = f"{'kernel':<22} {'sm':>3} {'dtype':<5} {'D':>4} {'warps':>5} " \
           f"{'shared B':>9} {'limit B':>8} {'regs':>4} {'spills':>6} {'stack B':>7}  problems"
    lines = [head, "-" * len(head)]
    for r in reports:
        lines.append(f"{r.kernel:<22} {r.arch:>3} {r.dtype:<5} {r.head_dim:>4} {r.num_warps:>5} "
                     f"{r.shared:>9} {r.shared_limit:>8} {r.registers:>4} "
                     f"{r.spill_instructions:>6} {r.stack_bytes:>7}  {'; '.join(r.problems)}")
    return "\n".join(lines)


def _csv(cast):
    return lambda text: tuple(cast(x) for x in text.split(",") if x.strip())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vase_sglang.ops.aot",
                                description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=_csv(int), default=ARCHS, help="compute capabilities (80,90,100)")
    p.add_argument("--dtype", type=_csv(str), default=tuple(DTYPES),
                   help="bf16,fp16,fp32,fp8e4m3,fp8e5m2 (of K/V; fp8 with bf16 queries; "
                   "fp8e4m3 is skipped below sm_89, where Triton has no e4m3)")
    p.add_argument("--head-dim", type=_csv(int), default=HEAD_DIMS, help="head dims (64,128,256)")
    p.add_argument("--wrapper", type=_csv(str), default=tuple(WRAPPERS),
                   help=f"launch wrappers to compile (default all: {','.join(WRAPPERS)})")
    p.add_argument("--jobs", type=int, default=1, help="processes, one architecture each")
    p.add_argument("--strict", action="store_true", help="also fail on register spills")
    p.add_argument("--json", help="write the reports here")
    args = p.parse_args(argv)
    if bad := [a for a in args.arch if a not in SHARED_LIMIT]:
        p.error(f"--arch: no shared-memory limit known for {bad}; known: {sorted(SHARED_LIMIT)}")
    if bad := [t for t in args.dtype if t not in DTYPES]:
        p.error(f"--dtype: unknown {bad}; known: {sorted(DTYPES)}")
    if bad := [w for w in args.wrapper if w not in WRAPPERS]:
        p.error(f"--wrapper: unknown {bad}; known: {sorted(WRAPPERS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    reports = compile_report_parallel(args.wrapper, args.arch, args.dtype, args.head_dim, args.jobs)
    seconds = time.perf_counter() - start
    print(format_table(reports))
    failing = [r for r in reports if r.problems]
    spilling = [r for r in reports if r.warnings]
    print(f"\n{len(reports)} kernels compiled in {seconds:.1f} s: {len(failing)} over an "
          f"architecture limit, {len(spilling)} spill registers"
          f"{' (--strict: a failure)' if args.strict and spilling else ''}")
    if args.json:
        import triton

        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "seconds": seconds,
                       "kernels": [asdict(r) for r in reports]}, f, indent=1)
    return 1 if failing or (args.strict and spilling) else 0


if __name__ == "__main__":
    sys.exit(main())
