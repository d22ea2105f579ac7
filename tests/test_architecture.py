"""The architecture's rules, read from the source: data flows edge_un -> converters -> quant ->
service, and no module reaches into another of the project's packages' (or the tests') private
names.

Read with ``ast``, not by importing: a rule broken in a module no test imports still fails here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The product's packages, left to right: a package may import those to its left, never right.
LAYERS = ("edge_un", "converters", "quant", "service")
# Packages that use the product from outside (any layer), and are never imported by it.
USERS = ("benchmarks", "testbed")


@dataclass(frozen=True)
class Use:
    module: str  # the using file, as a dotted name
    line: int
    imported: str  # the other package's module
    name: str | None  # the name taken from it (None: the module itself)


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def uses(path: Path, module: str | None = None) -> list[Use]:
    """Every import in ``path`` (the module ``module``, default: its place in the tree) and
    every private attribute read from an imported name."""
    module = module or dotted(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: list[Use] = []
    bound: dict[str, str] = {}  # local name -> the module it came from
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Use(module, node.lineno, alias.name, None))
                bound[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node, path.name == "__init__.py")
            for alias in node.names:
                found.append(Use(module, node.lineno, source, alias.name))
                bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and is_private(node.attr)
        ):
            found.append(Use(module, node.lineno, bound[node.value.id], node.attr))
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def top(name: str) -> str:
    return name.split(".")[0]


def product_and_users() -> list[Path]:
    return [path for package in (*LAYERS, *USERS) for path in modules(package)]


def test_the_rules_see_every_package() -> None:
    """The checks below pass vacuously if they read nothing: they read the whole product."""
    paths = product_and_users()
    assert {top(dotted(p)) for p in paths} == {*LAYERS, *USERS}
    assert len(paths) > 100


@pytest.mark.parametrize("layer", LAYERS)
def test_no_package_imports_one_to_its_right(layer: str) -> None:
    right = set(LAYERS[LAYERS.index(layer) + 1 :]) | set(USERS) | {"tests"}
    wrong = [
        f"{use.module}:{use.line} imports {use.imported}"
        for path in modules(layer)
        for use in uses(path)
        if top(use.imported) in right
    ]
    assert wrong == []


def test_no_module_uses_a_private_name_of_another_package() -> None:
    """Neither the product, its users nor the tests: a private name may change at any time."""
    wrong = []
    for path in [*product_and_users(), *modules("tests")]:
        for use in uses(path):
            # third-party privates (torch._export for .pt2 programs) are each library's business
            ours = top(use.imported) in (*LAYERS, *USERS, "tests")
            other = ours and top(use.imported) != top(use.module)
            private = any(is_private(part) for part in use.imported.split(".")[1:])
            private |= use.name is not None and is_private(use.name)
            if other and private:
                wrong.append(f"{use.module}:{use.line} uses {use.imported} {use.name or ''}")
    assert wrong == []


def test_nothing_outside_the_tests_imports_them() -> None:
    wrong = [
        f"{use.module}:{use.line} imports {use.imported}"
        for path in product_and_users()
        for use in uses(path)
        if top(use.imported) == "tests"
    ]
    assert wrong == []


def test_the_rules_catch_what_they_forbid(tmp_path: Path) -> None:
    """Each rule fails on a module that breaks it (the checks are able to fail)."""
    sample = tmp_path / "probe.py"
    sample.write_text(
        "from service.jobs import create\n"
        "from converters.pipeline import _one_line\n"
        "import tests.servers\n"
        "import service.storage as storage\n"
        "storage._private_helper()\n"
    )
    found = {(use.imported, use.name) for use in uses(sample, "quant.probe")}
    assert ("service.jobs", "create") in found
    assert ("converters.pipeline", "_one_line") in found
    assert ("tests.servers", None) in found
    assert ("service.storage", "_private_helper") in found
