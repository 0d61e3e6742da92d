"""The package's layers: imports run downward only, with no circles and no borrowed underscore names;
CONTRIBUTING's Layout lists every module."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "optlab"
LAYERS = ("core", "studies", "book", "commands")  # bottom to top
# The core's own floors, bottom to top: its two shared modules, then its sub-packages; parts on one floor are peers.
CORE_FLOORS = (("errors", "workload"), ("results", "knobs"), ("process",), ("cifar", "gpt"), ("machine",),
               ("measuring",), ("stats", "techniques"), ("run",))
MAX_MODULES = 12  # no folder holds more modules than this: more, and it wants sub-packages


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, package: Path) -> bool:
    path = package.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def imports(path: Path, package: Path = PACKAGE) -> list[tuple[str, list[str]]]:
    """Every optlab module ``path`` imports, with the names it takes from it (relative imports resolved)."""
    own = module_name(path, package) if path.name == "__init__.py" else module_name(path, package).rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = own.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            if target.startswith("optlab"):
                modules = [f"{target}.{n}" for n in names if is_module(f"{target}.{n}", package)]
                found += [(m, []) for m in modules]
                found.append((target, [n for n in names if f"{target}.{n}" not in modules]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("optlab")]
    return found


def modules(package: Path) -> dict[str, Path]:
    return {module_name(path, package): path for path in package.rglob("*.py") if path.name != "__main__.py"}


MODULES = modules(PACKAGE)


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def core_floor(module: str) -> int | None:
    """The floor of a core module by its part (``optlab.core.measuring.timing``: measuring's); None for the core's
    face (``optlab.core`` itself, which imports the workloads and techniques to register them) and outside it."""
    parts = module.split(".")
    if parts[:2] != ["optlab", "core"] or len(parts) < 3:
        return None
    return next((floor for floor, names in enumerate(CORE_FLOORS) if parts[2] in names), None)


def faults(module: str, package: Path = PACKAGE) -> list[str]:
    """What ``module`` of ``package`` does wrong: imports from a layer above it, private names it takes."""
    found, own, paths = [], layer(module), modules(package)
    for target, names in imports(paths[module], package):
        if own is not None and layer(target) is not None and layer(target) > own:
            found.append(f"{module} imports {target}, a layer above it")
        mine, theirs = core_floor(module), core_floor(target)
        if mine is not None and theirs is not None and theirs > mine:
            found.append(f"{module} imports {target}, a part of the core above its own")
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        if private:
            found.append(f"{module} imports private names {private} from {target}")
    source = paths[module].read_text()
    for other in paths:
        short = other.rsplit(".", 1)[-1]
        if f"{short}._" in source.replace(f"{short}.__", ""):
            found.append(f"{module} reads a private name of {other}")
    return found


def import_circle(package: Path) -> list[str] | None:
    """One import circle among the modules of ``package`` (first module repeated at the end), or None."""
    paths = modules(package)
    graph = {m: {t for t, _ in imports(p, package) if t in paths and t != m} for m, p in paths.items()}
    # a package's __init__ re-exporting its own modules is not a circle: drop edges from a module to its parents
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (circle := visit(target, path + [target])):
                return circle
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module, [module])):
            return circle
    return None


def test_every_core_part_has_a_floor_and_says_its_job():
    core = PACKAGE / "core"
    parts = {p.stem for p in core.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in core.iterdir() if (p / "__init__.py").exists()}
    assert parts == {name for floor in CORE_FLOORS for name in floor}
    for part in (p for p in core.iterdir() if (p / "__init__.py").exists()):
        assert ast.get_docstring(ast.parse((part / "__init__.py").read_text())), f"core/{part.name} has no docstring"


def folders_over(package: Path, limit: int = MAX_MODULES) -> list[str]:
    """Every folder of ``package`` that holds more than ``limit`` modules, with its count."""
    return [f"{folder.relative_to(package.parent)}: {count} modules"
            for folder in (package, *(p.parent for p in package.rglob("__init__.py")))
            if (count := len([p for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")])) > limit]


def test_no_folder_holds_more_than_a_dozen_modules():
    assert not folders_over(PACKAGE)


def test_the_core_walk_sees_a_part_importing_a_part_above_it(tmp_path):
    """The floors can fail: a measuring module that imports the run's experiments is named, and so is a crowded folder."""
    fake = tmp_path / "optlab"
    for folder in ("core", "core/measuring", "core/run"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text('"""x"""\n')
    (fake / "__init__.py").write_text("")
    (fake / "core" / "measuring" / "timing.py").write_text("from ..run import experiments\n")
    (fake / "core" / "run" / "experiments.py").write_text("from ..measuring import timing\n")
    assert faults("optlab.core.measuring.timing", fake) == [
        f"optlab.core.measuring.timing imports {m}, a part of the core above its own"
        for m in ("optlab.core.run.experiments", "optlab.core.run")]
    assert faults("optlab.core.run.experiments", fake) == []
    for n in range(3):
        (fake / "core" / "run" / f"m{n}.py").write_text("")
    assert folders_over(fake, limit=3) == ["optlab/core/run: 4 modules"]


def test_the_folders_are_the_layers():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert set(LAYERS) <= set(folders)
    for name in LAYERS:
        assert ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())), f"{name} has no docstring"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downward_and_take_no_private_names(module):
    assert not faults(module)


def test_no_import_circles():
    circle = import_circle(PACKAGE)
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_walk_sees_a_circle_an_upward_import_and_a_private_name(tmp_path):
    """The checks above can fail: the same walk on a made-up package finds each fault."""
    fake = tmp_path / "optlab"
    for folder in ("core", "book"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text('"""x"""\n')
    (fake / "__init__.py").write_text("")
    (fake / "core" / "a.py").write_text("from . import b\nfrom ..book import page\n")
    (fake / "core" / "b.py").write_text("from .a import _helper\n")
    (fake / "core" / "c.py").write_text("from . import b\nb._secret()\n")
    (fake / "book" / "page.py").write_text("")
    (fake / "book" / "view.py").write_text("from ..core import c\n")
    circle = import_circle(fake)
    assert circle[0] == circle[-1] and set(circle) == {"optlab.core.a", "optlab.core.b"}
    assert faults("optlab.core.a", fake) == [f"optlab.core.a imports {m}, a layer above it"
                                             for m in ("optlab.book.page", "optlab.book")]
    assert faults("optlab.core.b", fake) == ["optlab.core.b imports private names ['_helper'] from optlab.core.a"]
    assert faults("optlab.core.c", fake) == ["optlab.core.c reads a private name of optlab.core.b"]
    assert faults("optlab.book.view", fake) == []  # downward is allowed
    (fake / "core" / "b.py").write_text("")
    assert import_circle(fake) is None


# CONTRIBUTING's Layout: each folder's line says what it is for; its modules follow, after a colon on the same line or on
# the lines below, as a comma-separated list. An entry is a name, or names joined by "+", with an optional gloss in
# parentheses; a sub-package is "name/ (its modules, ...)".
NAME = r"[a-z_][a-z0-9_]*"


def layout_sections(readme: str) -> dict[str, str]:
    """The list of names under each folder of a Layout block, as written."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    sections, current = {}, None
    for line in block.splitlines():
        if folder := re.match(rf"  ({NAME})/\s+(.*)", line):
            current = folder[1]
            sections[current] = folder[2].split(":", 1)[1] if ":" in folder[2] else ""
        elif current and line.startswith("   "):
            sections[current] += " " + line.strip()
    return sections


def listed_names(text: str) -> set[str]:
    """The module names of one Layout list; a sub-package's modules as ``package.module``."""
    names = set()
    for entry in filter(None, (e.strip() for e in re.split(r",(?![^()]*\))", text))):
        if package := re.fullmatch(rf"({NAME})/\s*\((.*)\)", entry):
            names |= {package[1], *(f"{package[1]}.{name}" for name in listed_names(package[2]))}
            continue
        for name in re.sub(r"\s*\([^()]*\)$", "", entry).split("+"):
            assert re.fullmatch(NAME, name.strip()), f"the Layout lists {name.strip()!r}, not a module name"
            names.add(name.strip())
    return names


def package_names(folder: Path) -> set[str]:
    """The modules and sub-packages of ``folder``; a sub-package's modules as ``package.module``."""
    names = {p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")}
    for sub in (p for p in folder.iterdir() if (p / "__init__.py").exists()):
        names |= {sub.name, *(f"{sub.name}.{name}" for name in package_names(sub))}
    return names


def test_the_layout_reads_listed_names_only():
    sections = layout_sections("## Layout\n```\noptlab/\n  core/       the knobs, as data\n"
                               "              config, data (stand-in images), registry + techniques\n"
                               "  book/       what the chapters show: chapter, tools/ (plots, tables)\n```\n")
    assert {folder: listed_names(text) for folder, text in sections.items()} == {
        "core": {"config", "data", "registry", "techniques"},
        "book": {"chapter", "tools", "tools.plots", "tools.tables"}}
    with pytest.raises(AssertionError, match="'the knobs'"):
        listed_names("config, the knobs")


def test_the_contributing_layout_lists_every_module_in_its_folder():
    sections = layout_sections((PACKAGE.parent / "CONTRIBUTING.md").read_text())
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert set(sections) == folders, "CONTRIBUTING's Layout and optlab/ have different folders"
    for folder in sorted(folders):
        listed, present = listed_names(sections[folder]), package_names(PACKAGE / folder)
        assert listed == present, (f"CONTRIBUTING's Layout under {folder}/ lacks {sorted(present - listed)} "
                                   f"and lists {sorted(listed - present)}, which optlab/{folder}/ lacks")
