"""The training corpus that needs no download: the Python standard library's own source.

    <stdlib>/**/*.py of the running interpreter, tests and idlelib left out
        split by top-level module:
            held-out  HELDOUT_MODULES (~320 KB), committed as data/heldout.jsonl, so an
                      interpreter of another version evaluates on the very same text
            train     every other module

A corpus is a list of (relative path, sha256) by file and one hash of that list
(`Corpus.digest`); `baton train` records the train part's digest and refuses, in one line, a
corpus that is missing or whose digest differs (another Python version, an edited file).
`python -m baton.train.corpus` rewrites data/ from this interpreter (done once; the manifest
says which version wrote it).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from baton.errors import ConfigError

DATA = Path(__file__).parent / "data"
HELDOUT_FILE = DATA / "heldout.jsonl"
MANIFEST_FILE = DATA / "corpus.json"
HELDOUT_MODULES = ("argparse", "contextlib", "difflib", "functools", "heapq", "py_compile",
                   "stat", "symtable", "telnetlib")
"""Chosen once by sha256("heldout:" + module) order among modules under 120 KB, until
300 KB: a fixed list, so the split does not move with the interpreter's version."""
SKIP_DIRS = {"test", "tests", "idlelib", "idle_test", "site-packages", "dist-packages",
             "__pycache__"}


@dataclass(frozen=True)
class Doc:
    path: str
    """Relative to the stdlib folder, '/'-separated."""
    text: str

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def module(self) -> str:
        return self.path.split("/")[0].removesuffix(".py")


def digest(docs: list[Doc]) -> str:
    """The hash of a corpus: sha256 of its "path sha256" lines, in path order."""
    h = hashlib.sha256()
    for d in sorted(docs, key=lambda d: d.path):
        h.update(f"{d.path} {d.sha256}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: list[Doc]
    heldout: list[Doc]

    @property
    def digest(self) -> str:
        """The train part's hash (what a training run depends on)."""
        return digest(self.train)

    @property
    def train_bytes(self) -> int:
        return sum(len(d.text.encode()) for d in self.train)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def scan(root: Path | None = None) -> Corpus:
    """Read the corpus under `root` (default: this interpreter's stdlib); ConfigError when it
    is missing (no such folder, or no .py sources: a Python installed without them)."""
    root = Path(root) if root is not None else stdlib_root()
    docs = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for f in sorted(files):
            if f.endswith(".py"):
                p = Path(dirpath) / f
                rel = p.relative_to(root).as_posix()
                docs.append(Doc(rel, p.read_text(encoding="utf-8", errors="replace")))
    if not any(d.module == "argparse" for d in docs):
        raise ConfigError(f"corpus missing: {root} holds no Python standard library source "
                          f"(argparse.py not found); install this Python's source files or "
                          f"pass --corpus DIR")
    held = set(HELDOUT_MODULES)
    return Corpus(root, [d for d in docs if d.module not in held],
                  [d for d in docs if d.module in held])


def check(corpus: Corpus, expected: str) -> None:
    """ConfigError (one line) when the train part's digest is not `expected` (or, given 16
    or more hex digits, does not start with them)."""
    if len(expected) < 16 or not corpus.digest.startswith(expected):
        raise ConfigError(
            f"corpus changed: the train part of {corpus.root} ({len(corpus.train)} files) "
            f"hashes {corpus.digest[:16]}, the settings expect {expected[:16]} (Python "
            f"{manifest().get('python', '?')}'s stdlib); run with that Python, or pass "
            f"--corpus-hash {corpus.digest[:16]} to train on this one")


def heldout() -> list[Doc]:
    """The committed held-out text (the same on every interpreter); ConfigError if it was
    edited (its hash is in the manifest)."""
    if not HELDOUT_FILE.is_file():
        raise ConfigError(f"corpus missing: {HELDOUT_FILE} (the committed held-out text)")
    docs = [Doc(**json.loads(line)) for line in HELDOUT_FILE.read_text().splitlines() if line]
    want = manifest()["heldout_sha256"]
    if digest(docs) != want:
        raise ConfigError(f"corpus changed: {HELDOUT_FILE} hashes {digest(docs)[:16]}, the "
                          f"manifest {MANIFEST_FILE.name} says {want[:16]}")
    return docs


def manifest() -> dict:
    return json.loads(MANIFEST_FILE.read_text()) if MANIFEST_FILE.is_file() else {}


def write_data(corpus: Corpus) -> None:
    """data/heldout.jsonl and data/corpus.json (the file list with hashes, both digests)."""
    DATA.mkdir(exist_ok=True)
    HELDOUT_FILE.write_text("".join(json.dumps({"path": d.path, "text": d.text}) + "\n"
                                    for d in corpus.heldout))
    m = {"python": platform.python_version(), "heldout_modules": list(HELDOUT_MODULES),
         "train_sha256": corpus.digest, "heldout_sha256": digest(corpus.heldout),
         "train_bytes": corpus.train_bytes,
         "heldout_bytes": sum(len(d.text.encode()) for d in corpus.heldout),
         "files": [[d.path, len(d.text.encode()), d.sha256[:16], "heldout" if d in
                    corpus.heldout else "train"] for d in
                   sorted(corpus.train + corpus.heldout, key=lambda d: d.path)]}
    files = m.pop("files")  # one line a file
    head = json.dumps(m, indent=1)[:-2]
    MANIFEST_FILE.write_text(head + ',\n "files": [\n' + ",\n".join(
        "  " + json.dumps(f) for f in files) + "\n ]\n}\n")


if __name__ == "__main__":
    c = scan()
    write_data(c)
    print(f"{len(c.train)} train files ({c.train_bytes} bytes, {c.digest[:16]}), "
          f"{len(c.heldout)} held-out files -> {DATA}")
