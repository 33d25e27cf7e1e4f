"""pool_layout and kernels are leaves: they never import the engine or the adapters."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"rollout_engine", "trainer_adapters"}
LEAVES = {"pool_layout": FORBIDDEN, "kernels": FORBIDDEN | {"pool_layout"}}


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(LEAVES))
def test_leaf_packages_import_no_upper_layer(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no python files"
    bad = {str(f.relative_to(ROOT)): imported_packages(f) & LEAVES[package] for f in files}
    assert not {f: names for f, names in bad.items() if names}


def test_pool_layout_imports_only_torch_and_stdlib():
    import sys
    allowed = {"torch", "__future__"} | set(sys.stdlib_module_names)
    for f in sorted((ROOT / "pool_layout").rglob("*.py")):
        assert imported_packages(f) <= allowed, f
