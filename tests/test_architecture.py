"""The architecture's rules, read from the source: data flows edge_un -> converters -> quant ->
service, the folders of a package depend on each other one way (none imports one that imports
it back, directly or round a cycle), and no module reaches into another of the project's
packages' (or the tests') private names.

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
USERS = ("benchmarks", "testbed", "tools")


@dataclass(frozen=True)
class Use:
    module: str  # the using file, as a dotted name
    line: int
    imported: str  # the other package's module
    name: str | None  # the name taken from it (None: the module itself)


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def dotted(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def uses(path: Path, module: str | None = None, root: Path = ROOT) -> list[Use]:
    """Every import in ``path`` (the module ``module``, default: its place in the tree under
    ``root``) and every private attribute read from an imported name."""
    module = module or dotted(path, root)
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


def folder_imports(paths: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Which folders (subpackages, at any depth) import which of their sibling folders: a
    module inside folder ``p.a`` (at any depth below it) importing anything inside ``p.b``."""
    graph: dict[str, set[str]] = {}
    for path in paths:
        inside = path.relative_to(root).with_suffix("").parts  # the file's own place
        for use in uses(path, root=root):
            for name in filter(None, [use.imported, use.name and f"{use.imported}.{use.name}"]):
                target = name.split(".")
                shared = 0
                while shared < min(len(inside), len(target)) and inside[shared] == target[shared]:
                    shared += 1
                in_folder = 0 < shared < len(inside) - 1  # the importer lies below a sibling
                other = target[: shared + 1]
                if in_folder and len(target) > shared and root.joinpath(*other).is_dir():
                    graph.setdefault(".".join(inside[: shared + 1]), set()).add(".".join(other))
    return graph


def module_imports(paths: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Which of ``paths``'s modules import which other module among them (at module level or
    inside a function: a lazy import still ties the two): ``from p import m`` names the module
    ``p.m`` where it is one, else ``p``."""
    known = {dotted(path, root) for path in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        me = dotted(path, root)
        for use in uses(path, me, root):
            named = f"{use.imported}.{use.name}" if use.name else None
            target = named if named in known else use.imported
            if target in known and target != me:
                graph.setdefault(me, set()).add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every folder that reaches itself through the graph, with the way round (shortest)."""
    found = []
    for start in sorted(graph):
        ways = [[start, after] for after in sorted(graph[start])]
        seen: set[str] = set()
        while ways:
            way = ways.pop(0)
            if way[-1] == start:
                found.append(way)
                break
            if way[-1] not in seen:
                seen.add(way[-1])
                ways += [[*way, after] for after in sorted(graph.get(way[-1], ()))]
    return found


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


@pytest.mark.parametrize("layer", LAYERS)
def test_no_two_folders_of_a_package_import_each_other(layer: str) -> None:
    """A package's folders (service: server, worker, cli, client, db; server: api, web,
    uploads; ...) depend on each other one way: none imports a folder that imports it back,
    directly or round a cycle."""
    graph = folder_imports(modules(layer))
    top = ROOT / layer
    folders = [p.parent for p in modules(layer) if p.name == "__init__.py" and p.parent != top]
    assert bool(graph) == bool(folders), f"{layer}: its folders {folders}, read {graph}"
    assert [" -> ".join(way) for way in cycles(graph)] == []


# quant's folders and the others each may import (its top-level modules, the orchestration,
# may import any): a measurement never needs a builder, and neither builder the other's runtime.
QUANT_SEAMS = {
    "quant.measure": set(),
    "quant.targets": {"quant.measure"},
    "quant.report": {"quant.measure", "quant.targets"},
    "quant.ort": {"quant.measure", "quant.targets", "quant.report"},
    "quant.tflite": {"quant.measure", "quant.targets", "quant.report"},
}


def test_quant_folders_import_only_across_their_seams() -> None:
    """quant.ort and quant.tflite never import each other; quant.measure imports no other
    folder (no builder, no report); the report and the profiles no builder."""
    graph = folder_imports(modules("quant"))
    folders = {dotted(p.parent) for p in modules("quant") if p.name == "__init__.py"}
    assert {f for f in folders if f.count(".") == 1} == set(QUANT_SEAMS)  # every folder has a rule
    wrong = {
        folder: sorted(graph.get(folder, set()) - allowed)
        for folder, allowed in QUANT_SEAMS.items()
    }
    assert {folder: found for folder, found in wrong.items() if found} == {}
    assert graph["quant.ort"] and graph["quant.tflite"]  # it read their imports


def test_no_standing_benchmark_imports_a_study() -> None:
    """benchmarks/: the standing groups may import each other (one way) and ``common``;
    ``studies`` may import any of them; nothing imports a study, and ``common`` no group."""
    graph = folder_imports(modules("benchmarks"))
    assert graph["benchmarks.studies"]  # it read the studies' imports
    importing_studies = sorted(
        f for f, imported in graph.items() if "benchmarks.studies" in imported
    )
    assert importing_studies == []
    assert graph.get("benchmarks.common", set()) == set()


def test_no_two_modules_import_each_other() -> None:
    """Modules depend on each other one way, in the product and in its users (benchmarks,
    testbed): none imports a module that imports it back, directly or round a cycle. A
    package's ``__init__`` re-exporting its modules is one way too (they import the modules
    they need, never the package)."""
    graph = module_imports(product_and_users())
    assert len(graph) > 100  # it read the imports
    assert [" -> ".join(way) for way in cycles(graph)] == []


def test_the_module_rule_catches_modules_that_import_each_other(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "from .a import run\n",
        "pkg/a.py": "def run():\n    from pkg import b\n",  # a lazy import counts
        "pkg/b.py": "from . import a\n",
        "pkg/c.py": "from pkg.a import run\n",  # one way: no cycle
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = module_imports(sorted((tmp_path / "pkg").rglob("*.py")), tmp_path)
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert {" -> ".join(way) for way in cycles(graph)} == {
        "pkg.a -> pkg.b -> pkg.a",
        "pkg.b -> pkg.a -> pkg.b",
    }


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
        "from converters.fold_and_export import _one_line\n"
        "import tests.servers\n"
        "import service.storage as storage\n"
        "storage._private_helper()\n"
    )
    found = {(use.imported, use.name) for use in uses(sample, "quant.probe")}
    assert ("service.jobs", "create") in found
    assert ("converters.fold_and_export", "_one_line") in found
    assert ("tests.servers", None) in found
    assert ("service.storage", "_private_helper") in found


def test_the_folder_rule_catches_folders_that_import_each_other(tmp_path: Path) -> None:
    """Two folders importing each other (relative and absolute imports, at any depth), and
    three round a cycle, each fail the folder rule; one-way imports pass it."""
    files = {
        "pkg/__init__.py": "",
        "pkg/shared.py": "",
        "pkg/a/__init__.py": "from ..b import tool\n",
        "pkg/a/deep/x.py": "import pkg.shared\n",
        "pkg/b/__init__.py": "",
        "pkg/b/tool.py": "from pkg.a.deep import x\n",
        "pkg/c/__init__.py": "from ..shared import y\nfrom ..b import tool\n",
        "pkg/c/api/__init__.py": "from ..web.pages import page\n",
        "pkg/c/web/__init__.py": "",
        "pkg/c/web/pages.py": "from ..api import routes\n",
        "pkg/d/__init__.py": "from ..e import f\n",
        "pkg/e/__init__.py": "from pkg.f import g\n",
        "pkg/f/__init__.py": "from ..d import h\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = folder_imports(sorted((tmp_path / "pkg").rglob("*.py")), tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.b"}  # a module beside the folders is no folder
    assert graph["pkg.c.api"] == {"pkg.c.web"} and graph["pkg.c.web"] == {"pkg.c.api"}
    found = {" -> ".join(way) for way in cycles(graph)}
    assert {"pkg.a -> pkg.b -> pkg.a", "pkg.c.api -> pkg.c.web -> pkg.c.api"} <= found
    assert "pkg.d -> pkg.e -> pkg.f -> pkg.d" in found
    assert not any(way.startswith("pkg.c ->") for way in found)  # c only imports one way
    assert cycles({"pkg.c": {"pkg.b"}, "pkg.b": set()}) == []
