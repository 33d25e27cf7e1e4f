"""pool_layout and rollout_kernels are leaves: they never import the engine or the adapters."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"rollout_engine", "trainer_adapters"}
LEAVES = {"pool_layout": FORBIDDEN, "rollout_kernels": FORBIDDEN | {"pool_layout"}}


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


def test_the_engine_imports_no_trainer_adapters():
    bad = [str(f.relative_to(ROOT)) for f in sorted((ROOT / "rollout_engine").rglob("*.py"))
           if "trainer_adapters" in imported_packages(f)]
    assert not bad


def private_names(package: Path) -> set[str]:
    """Every underscore name the package defines: functions, methods, classes, attributes set on objects."""
    names = set()
    for f in package.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def test_nothing_outside_the_engine_touches_its_private_names():
    """Tests, benchmarks, adapters and examples use the engine's public API: no `x._name` of a name the
    engine defines (other than on their own `self`), and no import of one."""
    private = private_names(ROOT / "rollout_engine")
    offenders = []
    for folder in ("tests", "benchmarks", "trainer_adapters", "examples"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
                if (isinstance(node, ast.Attribute) and node.attr in private
                        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                    offenders.append(f"{f.relative_to(ROOT)}:{node.lineno} .{node.attr}")
                elif (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollout_engine")
                      and any(alias.name.startswith("_") for alias in node.names)):
                    offenders.append(f"{f.relative_to(ROOT)}:{node.lineno} import from {node.module}")
    assert not offenders


def shipped_packages() -> set[str]:
    """The top-level packages pyproject.toml ships (its find-include patterns, one per package)."""
    tomllib = pytest.importorskip("tomllib")
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    return {pattern.rstrip("*") for pattern in include}


def test_no_other_installed_distribution_ships_a_package_of_ours():
    """A top-level package of ours that another distribution also ships shadows it (or, installed into
    site-packages, overwrites its files): transformers requires Hugging Face's `kernels`, which a package of
    ours named `kernels` hid, so that importing transformers' models failed."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    ours = {"rollout-engine", "rollout_engine"}
    clashes = {name: owners[name] for name in shipped_packages() if set(owners.get(name, ())) - ours}
    assert not clashes


def test_transformers_hub_kernels_import_beside_the_engine():
    import rollout_engine  # noqa: F401  (puts the repository's packages first on the path, as a user's import does)
    import importlib

    importlib.import_module("transformers.integrations.hub_kernels")
