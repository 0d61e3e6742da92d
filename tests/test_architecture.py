"""The package's layers: imports run downward only, with no circles and no borrowed underscore names."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "optlab"
LAYERS = ("core", "studies", "book", "commands")  # bottom to top


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """Every optlab module ``path`` imports, with the names it takes from it (relative imports resolved)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            if target.startswith("optlab"):
                modules = [f"{target}.{n}" for n in names if (PACKAGE.parent / f"{target}.{n}".replace(".", "/")).with_suffix(".py").exists()
                           or (PACKAGE.parent / f"{target}.{n}".replace(".", "/")).is_dir()]
                found += [(m, []) for m in modules]
                found.append((target, [n for n in names if f"{target}.{n}" not in modules]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("optlab")]
    return found


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py") if path.name != "__main__.py"}


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_folders_are_the_layers():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert set(LAYERS) <= set(folders)
    for name in LAYERS:
        assert ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())), f"{name} has no docstring"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downward_and_take_no_private_names(module):
    own = layer(module)
    for target, names in imports(MODULES[module]):
        if own is not None and layer(target) is not None:
            assert layer(target) <= own, f"{module} imports {target}, a layer above it"
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        assert not private, f"{module} imports private names {private} from {target}"
    source = MODULES[module].read_text()
    for other in MODULES:
        short = other.rsplit(".", 1)[-1]
        assert f"{short}._" not in source.replace(f"{short}.__", ""), f"{module} reads a private name of {other}"


def test_no_import_circles():
    graph = {m: {t for t, _ in imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}
    # a package's __init__ re-exporting its own modules is not a circle: drop edges from a module to its parents
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for target in graph[node]:
            if state.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_the_walk_sees_a_circle_and_an_upward_import(tmp_path):
    """The checks above can fail: the same walk on a made-up package finds both faults."""
    fake = tmp_path / "optlab"
    for folder in ("core", "book"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text('"""x"""\n')
    (fake / "core" / "a.py").write_text("from . import b\nfrom ..book import page\n")
    (fake / "core" / "b.py").write_text("from .a import _helper\n")
    (fake / "book" / "page.py").write_text("")
    global PACKAGE
    saved, PACKAGE = PACKAGE, fake
    try:
        found_a = imports(fake / "core" / "a.py")
        found_b = imports(fake / "core" / "b.py")
    finally:
        PACKAGE = saved
    assert ("optlab.core.b", []) in found_a and ("optlab.book.page", []) in found_a
    assert layer("optlab.book.page") > layer("optlab.core.a")
    assert ("optlab.core.a", ["_helper"]) in found_b


def test_the_readme_layout_names_every_module_in_its_folder():
    readme = (PACKAGE.parent / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    sections, current = {}, None
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            current = line.split()[0].rstrip("/")
        if current:
            sections[current] = sections.get(current, "") + " " + line
    for folder in LAYERS:
        names = {p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__"}
        names |= {p.name for p in (PACKAGE / folder).iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        missing = sorted(n for n in names if not re.search(rf"\b{n}\b", sections.get(folder, "")))
        assert not missing, f"README's Layout does not name {missing} under {folder}/"
    assert set(sections) >= set(LAYERS), "README's Layout lacks a layer's folder"
