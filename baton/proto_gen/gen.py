"""Regenerates the stubs in this folder from proto/baton/v1/*.proto with grpc_tools.protoc.

protoc writes `from baton.v1 import x_pb2`; the files live flat in baton/proto_gen, so the
imports are rewritten to `from baton.proto_gen import x_pb2`. Nothing else is edited.
Usage: python -m baton.proto_gen.gen [--out DIR]   (default: this folder)
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "baton" / "v1"
HERE = Path(__file__).resolve().parent
_IMPORT = re.compile(r"^from baton\.v1 import (\w+_pb2)", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Writes the stubs for every proto file into `out`; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR}; see its message above")
        written = []
        for src in sorted((Path(tmp) / "baton" / "v1").glob("*.py*")):
            dst = out / src.name
            dst.write_text(_IMPORT.sub(r"from baton.proto_gen import \1", src.read_text()))
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
