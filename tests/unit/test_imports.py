"""Imports point down: core <- worker plumbing <- transfer, router <- roles <- cluster <- CLI.

Every product module's imports (top-level and inside functions) are read from its AST and
checked against LAYERS: a module may import its own unit or a unit of an earlier layer,
never a peer in its own layer or anything above it. That also rules out package cycles.
Inside `baton.model`: the base (configs, registry, pools) <- the shared layers <- the
loaders and the families. Nothing in baton/ outside a family's folder imports that folder
(families are found through `baton.model.family`), and no two baton modules import each
other, directly or round a loop (typing-only imports aside).
"""

from __future__ import annotations

import ast
import re
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
    ("baton.model.layers",),
    ("baton.model.hybrid",),
    ("baton.model.loader",),
    ("baton.model.tp_loader",),
    ("baton.model.nemotron_h", "baton.model.qwen3_5"),
    ("baton.model.qwen3_next",),
    ("baton.agents",),
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
    for n in (3, 2, 1):
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


def imports_of(path: Path, module: str, typing_too: bool = True) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in the file (`typing_too` False:
    leaving out `if TYPE_CHECKING:` blocks)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip = set()
    if not typing_too:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip |= {id(n) for b in node.body for n in ast.walk(b)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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


def family_packages(root: Path) -> set[str]:
    """The family folders: packages under baton/model with a `family.py`."""
    return {f"baton.model.{p.parent.name}" for p in (root / "baton" / "model").glob("*/family.py")}


def family_imports(root: Path) -> list[str]:
    """Modules of baton/ outside a family's folder that import one (a layer, the engine,
    the loader, the CLI ...)."""
    families = family_packages(root)
    found = []
    for path in sorted((root / "baton").rglob("*.py")):
        module = module_name(root, path)
        if any(module == f or module.startswith(f + ".") for f in families):
            continue
        for line, target in imports_of(path, module):
            fam = next((f for f in families if target == f or target.startswith(f + ".")),
                       None)
            if fam is not None:
                found.append(f"{path.relative_to(root)}:{line}: {module} imports {target}")
    return sorted(set(found))


def module_graph(root: Path, package: str = "baton") -> dict[str, set[str]]:
    """module -> the package's modules it imports (at module level or inside functions;
    `if TYPE_CHECKING:` blocks left out: they never run)."""
    mods = {module_name(root, p): p for p in (root / package).rglob("*.py")}
    graph = {}
    for module, path in mods.items():
        graph[module] = set()
        for _, target in imports_of(path, module, typing_too=False):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles (strongly connected components of more than one module)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_nothing_outside_a_family_imports_it():
    assert family_packages(ROOT) >= {"baton.model.nemotron_h", "baton.model.qwen3_5"}
    assert family_imports(ROOT) == []


def test_no_import_cycle_in_baton():
    assert cycles(module_graph(ROOT)) == []


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
        "baton/model/nemotron_h.py:1: baton.model.nemotron_h imports baton.cache "
        "(baton.cache is not below baton.model.nemotron_h)",
        "router/server.py:1: router imports transfer.sender (transfer is not below router)",
    ]


def test_a_layer_or_the_engine_importing_a_family_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "baton/__init__.py": "",
        "baton/model/__init__.py": "",
        "baton/model/fam/__init__.py": "",
        "baton/model/fam/family.py": "",
        "baton/model/fam/model.py": "from baton.model.layers import mlp\n",
        "baton/model/layers/__init__.py": "",
        "baton/model/layers/mlp.py": "from baton.model.fam.config import Cfg\n",
        "baton/engine/__init__.py": "",
        "baton/engine/engine.py": "def f():\n    import baton.model.fam.model\n",
    })
    assert family_imports(root) == [
        "baton/engine/engine.py:2: baton.engine.engine imports baton.model.fam.model",
        "baton/model/layers/mlp.py:1: baton.model.layers.mlp imports baton.model.fam.config",
        "baton/model/layers/mlp.py:1: baton.model.layers.mlp imports baton.model.fam.config.Cfg",
    ]


def test_an_import_cycle_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "baton/__init__.py": "",
        "baton/a.py": "def f():\n    from baton import b\n",
        "baton/b.py": "from baton.c import x\n",
        "baton/c.py": "import baton.a\n",
        "baton/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import baton.e\n",
        "baton/e.py": "import baton.d\n",
    })
    assert cycles(module_graph(root)) == [["baton.a", "baton.b", "baton.c"]]


FAMILY_WORD = re.compile(r"nemotron|qwen", re.IGNORECASE)
"""The families Baton ships, as code would name them (`nemotron_h`, `Qwen35Model`, ...)."""
NAMED_IN = {
    "baton/cli.py": "help texts naming the trained models and families as examples",
}
"""Files outside the family folders allowed to name a family in code, and why. Comments and
docstrings (documentation naming examples) are not code and are not read."""


def _python_names(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every identifier, import and non-docstring string in a module naming a
    family (a bare string statement is a docstring, the module's or an attribute's)."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            texts = [n.value]
        elif isinstance(n, ast.Name):
            texts = [n.id]
        elif isinstance(n, ast.Attribute):
            texts = [n.attr]
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            texts = [n.name]
        elif isinstance(n, ast.arg):
            texts = [n.arg]
        elif isinstance(n, ast.keyword):
            texts = [n.arg or ""]
        elif isinstance(n, ast.alias):
            texts = [n.name, n.asname or ""]
        elif isinstance(n, ast.ImportFrom):
            texts = [n.module or ""]
        else:
            continue
        found += [(getattr(n, "lineno", 0), t) for t in texts if FAMILY_WORD.search(t)]
    return found


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def _cpp_names(path: Path) -> list[tuple[int, str]]:
    """(line, word) of every identifier or string word naming a family, comments left out."""
    src = _COMMENT.sub(lambda m: "\n" * m.group().count("\n"), path.read_text())
    return [(src[:m.start()].count("\n") + 1, m.group())
            for m in re.finditer(r"\w*(?:nemotron|qwen)\w*", src, re.IGNORECASE)]


def family_names(root: Path) -> list[str]:
    """Code in baton/ outside the family folders (Python and the C++ kernels) that names a
    family, except the files in NAMED_IN."""
    folders = {root / "baton" / "model" / f.rpartition(".")[2] for f in family_packages(root)}
    found = []
    for path in sorted((root / "baton").rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel in NAMED_IN or any(f in path.parents for f in folders):
            continue
        if path.suffix == ".py":
            hits = _python_names(path)
        elif path.suffix in (".cpp", ".h"):
            hits = _cpp_names(path)
        else:
            continue
        found += [f"{rel}:{line}: {text[:60]!r}" for line, text in hits]
    return found


def test_nothing_outside_a_family_names_it():
    assert family_names(ROOT) == []
    for rel in NAMED_IN:  # each exception still needed (else it goes)
        path = ROOT / rel
        assert path.is_file() and _python_names(path), rel


def test_family_names_are_found_in_code_not_in_comments(tmp_path):
    (tmp_path / "baton" / "model" / "fam").mkdir(parents=True)
    (tmp_path / "baton" / "model" / "fam" / "family.py").write_text("X = 'qwen3_5'\n")
    (tmp_path / "baton" / "a.py").write_text(
        '"""Serves Qwen3.5 and NemotronH."""\n\n# qwen\nMODE = "x"\n"""NemotronH: doc."""\n'
        "if MODE == 'nemotron_h':\n    pass\n")
    (tmp_path / "baton" / "k.cpp").write_text(
        "// Qwen's router\nint softmax_moe();\n/* NemotronH\n */ int qwen_moe();\n")
    assert family_names(tmp_path) == ["baton/a.py:6: 'nemotron_h'", "baton/k.cpp:4: 'qwen_moe'"]
