"""The packages' layers: each imports only from the layers below it, lazy imports included.
algorithms < replicas < cluster; loadgen, the HTTP client, stands beside cluster; tools
(benches, the simulator, training and the command line that gathers every package's
commands) is on top and may import any of them."""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "algorithms": {"replicas", "cluster", "loadgen", "tools"},
    "replicas": {"cluster", "loadgen", "tools"},
    "cluster": {"loadgen", "tools"},
    "loadgen": {"cluster", "tools"},
}


def imported_packages(path: Path) -> set[str]:
    """The top-level packages that the module at ``path`` imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_from_the_layers_above(package):
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules
    wrong = {str(m.relative_to(ROOT)): sorted(imported_packages(m) & FORBIDDEN[package]) for m in modules}
    assert {module: names for module, names in wrong.items() if names} == {}


def test_the_scan_sees_lazy_imports():
    """``tools.cli`` gathers the commands of cluster and loadgen; ``cmd_up`` imports Ray in its body."""
    assert {"cluster", "loadgen", "tools"} <= imported_packages(ROOT / "tools" / "cli.py")
    assert "ray" in imported_packages(ROOT / "cluster" / "cli.py")


def test_every_package_is_installed_and_copied_into_the_image():
    """pyproject.toml installs each top-level package, and deploy/Dockerfile copies it."""
    packages = sorted(init.parent.name for init in ROOT.glob("*/__init__.py"))
    assert {"algorithms", "replicas", "cluster", "loadgen", "tools"} <= set(packages)
    included = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert [p for p in packages if f"{p}*" not in included or f" {p} {p}\n" not in dockerfile] == []
