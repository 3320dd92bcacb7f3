"""The package layers, read from the source with `ast` (nothing is imported):

- plugin/ never imports training/ (`treedraft.training`, `..training`), not even inside a function;
- heads/ never imports training/, plugin/ or scripts/, never vllm, and no transformers at module
  level; its module-level third-party imports are torch, safetensors and numpy only.

test_no_vllm_import.py proves the other half at run time: importing heads/ and training/ with
vllm blocked works.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("heads", "training", "plugin", "scripts")
HEADS_THIRD_PARTY = {"torch", "safetensors"}


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(absolute module name, line, at module level) of every import in `path`; a relative
    import is resolved against the file's package (heads/x.py: `..training` -> treedraft.training)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ["treedraft", path.parent.name]
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from treedraft import training` names the subpackage in the imported names
            names = [f"{base}.{a.name}" for a in node.names] if base == "treedraft" else [base]
            found += [(n, node.lineno, id(node) in top) for n in names]
    return found


def sources(layer: str) -> list[Path]:
    return sorted((ROOT / layer).glob("*.py"))


def _names(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("path", sources("plugin"), ids=lambda p: p.name)
def test_plugin_never_imports_training(path):
    bad = [f"{path.name}:{line} imports {m}" for m, line, _ in imports(path)
           if _names(m, "treedraft.training")]
    assert not bad, f"plugin/ must import heads/, never training/: {bad}"


@pytest.mark.parametrize("path", sources("heads"), ids=lambda p: p.name)
def test_heads_import_only_torch(path):
    bad = []
    for m, line, top in imports(path):
        where = f"{path.name}:{line} imports {m}"
        if _names(m, "treedraft.training", "treedraft.plugin", "treedraft.scripts", "vllm"):
            bad.append(where)
        elif top and _names(m, "transformers"):
            bad.append(f"{where} at module level")
        elif top and not m.startswith("treedraft."):
            root = m.split(".")[0]
            if root not in sys.stdlib_module_names and root not in HEADS_THIRD_PARTY:
                bad.append(f"{where} (third party allowed at module level: "
                           f"{', '.join(sorted(HEADS_THIRD_PARTY))})")
    assert not bad, f"heads/ is pure torch and imports no other treedraft layer: {bad}"


def test_the_walk_sees_the_forbidden_spellings(tmp_path):
    """The checks above catch absolute, relative and function-level imports."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    bad = plugin / "bad.py"
    bad.write_text("from ..training import config\nfrom treedraft import training\n"
                   "def f():\n    import treedraft.training.models\n    from .. import training\n")
    found = sorted((line, m, top) for m, line, top in imports(bad))
    assert found == [(1, "treedraft.training", True), (2, "treedraft.training", True),
                     (4, "treedraft.training.models", False), (5, "treedraft.training", False)]
