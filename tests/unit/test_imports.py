"""Imports point down: core <- worker plumbing <- transfer, router <- roles <- cluster <- CLI.

Every product module's imports (top-level and inside functions) are read from its AST and
checked against LAYERS: a module may import its own unit or a unit of an earlier layer,
never a peer in its own layer or anything above it. That also rules out package cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("baton", "router", "transfer", "prefill_worker", "decode_worker", "bench")

LAYERS: tuple[tuple[str, ...], ...] = (
    ("baton",),
    ("baton.errors",),
    ("baton.sampling", "baton.proto_gen"),
    ("baton.contract",),
    ("baton.config",),
    ("baton.auth",),
    ("baton.model",),
    ("baton.cache",),
    ("baton.engine",),
    ("baton.worker",),
    ("transfer", "router"),
    ("prefill_worker", "decode_worker"),
    ("baton.client", "baton.cluster", "baton.train"),
    ("tests.support",),
    ("bench",),
    ("baton.commands",),
    ("baton.cli",),
)
"""Units, lowest first. `baton` alone is the package's own __init__ (a version string)."""


def unit_of(module: str) -> str | None:
    """The LAYERS unit a dotted module name belongs to (None: not ours, e.g. a library)."""
    parts = module.split(".")
    for n in (2, 1):
        name = ".".join(parts[:n])
        if len(parts) >= n and any(name in layer for layer in LAYERS):
            return name
    return None


def rank(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def violations(root: Path, packages=PRODUCT) -> list[str]:
    found = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            module = module_name(root, path)
            src = unit_of(module)
            if src is None:
                continue
            seen = set()
            for line, target in imports_of(path, module):
                dst = unit_of(target)
                if dst is None or dst == src or (line, dst) in seen:
                    continue
                seen.add((line, dst))
                if rank(dst) >= rank(src):
                    found.append(f"{path.relative_to(root)}:{line}: {src} imports {target} "
                                 f"({dst} is not below {src})")
    return sorted(found)


def test_product_imports_point_down():
    assert violations(ROOT) == []


def test_every_product_module_has_a_layer():
    orphans = [module_name(ROOT, p) for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")
               if unit_of(module_name(ROOT, p)) is None]
    assert orphans == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_an_upward_import_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "baton/__init__.py": "",
        "baton/engine/__init__.py": "",
        "baton/engine/engine.py": "def f():\n    from router.server import run_router\n",
        "baton/model/nemotron_h.py": "from ..cache import manager\n",
        "router/__init__.py": "",
        "router/server.py": "import transfer.sender\nfrom baton.engine import engine\n",
        "transfer/__init__.py": "",
    })
    assert violations(root, ("baton", "router", "transfer")) == [
        "baton/engine/engine.py:2: baton.engine imports router.server "
        "(router is not below baton.engine)",
        "baton/model/nemotron_h.py:1: baton.model imports baton.cache "
        "(baton.cache is not below baton.model)",
        "router/server.py:1: router imports transfer.sender (transfer is not below router)",
    ]
