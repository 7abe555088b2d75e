"""llama.cpp as the peer engine of `bench engine --peer llamacpp`: its venv, the GGUF, a worker.

- `ensure_venv()`: `llama-cpp-python` 0.3.x from the package registry, built from its sdist
  (this compiles llama.cpp: about 15 minutes on 2 cores) into its own cached venv
  `<cache>/venvs/llamacpp`, never the project's. The sdist is kept beside it, because the
  wheel does not ship the converter: `convert_hf_to_gguf.py`, its `conversion/` package and
  `gguf-py` live only in the sdist's `vendor/llama.cpp/`.
- `convert(checkpoint, outtype)`: runs that converter with this (Baton's) python and the
  sdist's own `gguf-py` on the path (the registry's `gguf` can lag the converter), with two
  patches that only steer its input: `config.json` is read as written (transformers'
  AutoConfig rewrites a dense NemotronH config: MoE defaults, a pattern list whose `mlp`
  entries the converter does not count), and the pre-tokenizer is named `gpt-2` (what the
  byte-level tokenizer written here is). The GGUF is cached per checkpoint and type.
- `gguf(checkpoint, type)`: the converter's types (f32, f16, bf16, q8_0), or Q4_0 / Q4_K_M
  made from the f32 GGUF by llama.cpp's own quantizer (`llama_model_quantize`, run in the
  venv's python: Baton's has no llama.cpp). Cached the same way.
- `Worker`: the peer process (bench/llamacpp_worker.py under the venv's python).

Every failure is a `PeerUnavailable` with one line saying why (the bench skips with it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.common import cache_dir

VERSION = "0.3.*"
HERE = Path(__file__).resolve().parent


class PeerUnavailable(Exception):
    """The peer cannot be built or run here; str(e) is the one-line reason."""


def _venv() -> Path:
    return cache_dir() / "venvs" / "llamacpp"


def ensure_venv() -> Path:
    """The venv's python, building it on first use (minutes: compiles llama.cpp)."""
    venv = _venv()
    py = venv / "bin" / "python"
    if (venv / ".built").is_file():
        return py
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        raise PeerUnavailable("llama.cpp needs cmake and g++ to build; neither is optional")
    sdist = _sdist()
    log = venv.parent / "llamacpp-build.log"
    print(f"[bench engine] building llama-cpp-python into {venv} (log {log})",
          file=sys.stderr, flush=True)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2),
           "CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                         "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF"}
    with open(log, "w") as f:
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [str(py), "-m", "pip", "install", "-q", str(sdist), "numpy"]]
        for cmd in steps:
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode:
                raise PeerUnavailable(f"building llama-cpp-python failed: see {log}")
    (venv / ".built").write_text(sdist.name + "\n")
    return py


def _sdist() -> Path:
    """The llama-cpp-python sdist (downloaded once) unpacked: its `vendor/llama.cpp`."""
    src = _venv().parent / "llamacpp-src"
    found = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        src.mkdir(parents=True, exist_ok=True)
        # `--no-binary llama-cpp-python`, not `:all:`: that also forces the sdist's build
        # backend (scikit-build-core and its dependencies) to be built from source to read its
        # metadata, which on a loaded 2-core machine ran 50 minutes and ended with no sdist
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
               "llama-cpp-python", f"llama-cpp-python=={VERSION}", "-d", str(src)]
        if subprocess.run(cmd, capture_output=True).returncode:
            raise PeerUnavailable("the package registry did not give llama-cpp-python's sdist")
        found = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    return found[-1]


def converter_dir() -> Path:
    """`vendor/llama.cpp` of the sdist, unpacked once (converter, conversion/, gguf-py/)."""
    sdist = _sdist()
    root = sdist.parent / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not (root / "convert_hf_to_gguf.py").is_file():
        import tarfile

        top = sdist.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
        with tarfile.open(sdist) as tf:
            keep = [m for m in tf.getmembers() if m.name.startswith(top) and (
                m.name.startswith(top + "conversion/") or m.name.startswith(top + "gguf-py/")
                or m.name == top + "convert_hf_to_gguf.py")]
            tf.extractall(sdist.parent, members=keep, filter="data")
    if not (root / "convert_hf_to_gguf.py").is_file():
        raise PeerUnavailable(f"{sdist.name} ships no convert_hf_to_gguf.py")
    return root


_CONVERT = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base

class _AsWritten:
    @staticmethod
    def from_pretrained(*a, **k):
        raise ValueError("read config.json as written")

base.AutoConfig = _AsWritten
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(checkpoint: Path, outtype: str = "f32", extra: tuple[str, ...] = ()) -> Path:
    """GGUF of `checkpoint` (cached in the cache folder); `extra` converter flags (e.g.
    `--no-mtp` for a Qwen3.5 checkpoint without the multi-token-prediction head)."""
    out = cache_dir() / "gguf" / f"{checkpoint.name}-{outtype}.gguf"
    if out.is_file():
        return out
    root = converter_dir()
    src = cache_dir() / "gguf" / f"{checkpoint.name}-hf"
    _stage(checkpoint, src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    cmd = [sys.executable, "-c", _CONVERT, str(root), str(src), "--outtype", outtype,
           "--outfile", str(tmp), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode or not tmp.is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(f"convert_hf_to_gguf.py failed on {checkpoint.name}: {tail[0]}")
    tmp.rename(out)
    return out


GGUF_TYPES = {"f32": ("convert", "f32"), "f16": ("convert", "f16"), "bf16": ("convert", "bf16"),
              "q8_0": ("convert", "q8_0"), "q4_0": ("quantize", "LLAMA_FTYPE_MOSTLY_Q4_0"),
              "q4_k_m": ("quantize", "LLAMA_FTYPE_MOSTLY_Q4_K_M")}
"""GGUF type -> how it is made: the converter's `--outtype`, or llama.cpp's own quantizer
(`llama_model_quantize`, the `llama-quantize` tool's code) over the f32 GGUF with that ftype."""


def gguf_recipe(gtype: str) -> tuple[str, str]:
    """("convert", outtype) or ("quantize", ftype name) for GGUF type `gtype`."""
    if gtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type {gtype!r} is not one the bench makes; allowed: "
                         f"{', '.join(GGUF_TYPES)}")
    return GGUF_TYPES[gtype]


_QUANTIZE = """
import ctypes, sys
import llama_cpp as L
src, dst, ftype, threads = sys.argv[1:5]
L.llama_backend_init()
p = L.llama_model_quantize_default_params()
p.ftype = getattr(L, ftype)
p.nthread = int(threads)
sys.exit(1 if L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)) else 0)
"""


def gguf(checkpoint: Path, gtype: str, extra: tuple[str, ...] = (), py: Path | None = None,
         threads: int = 2) -> Path:
    """GGUF of `checkpoint` as `gtype` (GGUF_TYPES), cached beside convert()'s: a quantized
    one is made by llama.cpp's quantizer in the peer venv's python `py` from the f32 GGUF."""
    how, arg = gguf_recipe(gtype)
    if how == "convert":
        return convert(checkpoint, arg, extra)
    out = cache_dir() / "gguf" / f"{checkpoint.name}-{gtype}.gguf"
    if out.is_file():
        return out
    src = convert(checkpoint, "f32", extra)
    tmp = out.with_suffix(".part")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(py or ensure_venv()), "-c", _QUANTIZE, str(src), str(tmp), arg,
                        str(threads)], capture_output=True, text=True, env=env)
    if r.returncode or not tmp.is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(f"llama_model_quantize {gtype} failed on {checkpoint.name}: "
                              f"{tail[0]}")
    tmp.rename(out)
    return out


def _stage(checkpoint: Path, dst: Path) -> None:
    """A folder the converter reads: the checkpoint's files linked, plus a tokenizer when it
    has none (the bench feeds token ids, so any tokenizer of the right size will do)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    cfg = json.loads((checkpoint / "config.json").read_text())
    if "n_routed_experts" in cfg and "n_shared_experts" not in cfg:
        # NemotronH MoE: the converter reads `n_shared_experts`, which HF ignores (one
        # shared MLP of `moe_shared_expert_intermediate_size`); older Baton checkpoints lack it
        (dst / "config.json").unlink()
        (dst / "config.json").write_text(json.dumps({**cfg, "n_shared_experts": 1}))
    if not (checkpoint / "tokenizer.json").is_file():
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        (dst / "tokenizer.json").write_text(json.dumps(byte_tokenizer(vocab)))
        (dst / "tokenizer_config.json").unlink(missing_ok=True)
        (dst / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
            # unk named: transformers maps some model types (qwen3_5_moe_text) to a
            # tokenizer class that otherwise adds its own unk token past the vocab
            "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<pad>"}))


def byte_tokenizer(vocab: int) -> dict:
    """A byte-level BPE tokenizer.json of exactly `vocab` ids laid out as Baton's byte
    fallback: 0 pad, 1 bos, 2 eos, 3 + b byte b, then two-byte merges to fill the vocab."""
    chars = _byte_chars()
    ids = {c: 3 + b for b, c in enumerate(chars)}
    merges = []
    for a in chars:
        for b in chars:
            if len(ids) + 3 >= vocab:
                break
            ids[a + b] = len(ids) + 3
            merges.append(f"{a} {b}")
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True}
               for i, t in enumerate(("<pad>", "<s>", "</s>"))]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False,
                  "vocab": {"<pad>": 0, "<s>": 1, "</s>": 2, **ids}, "merges": merges},
    }


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


class Worker:
    """One llama.cpp process with a loaded model and context; `call(op, **args)`."""

    def __init__(self, py: Path, gguf: Path, threads: int, n_seq: int, n_ctx: int):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen(
            [str(py), str(HERE / "llamacpp_worker.py")], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.pid = self.proc.pid
        self.system = self.call("load", gguf=str(gguf), threads=threads, n_seq=n_seq,
                                n_ctx=n_ctx)["system"]

    def call(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise PeerUnavailable(f"the llama.cpp worker died during {op}")
        out = json.loads(line)
        if "error" in out:
            raise PeerUnavailable(f"llama.cpp: {out['error']}")
        return out

    def peak_rss_kb(self) -> int:
        """The worker process's peak resident memory so far (VmHWM), in KiB."""
        return peak_rss_kb(self.pid)

    def close(self) -> None:
        try:
            self.call("quit")
        except (PeerUnavailable, BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def peak_rss_kb(pid: int) -> int:
    """Peak resident memory (VmHWM of /proc/PID/status) of process `pid`, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise PeerUnavailable(f"/proc/{pid}/status has no VmHWM")
