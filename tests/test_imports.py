"""Imports run one way (docs/architecture.md): no cycle among the package's modules, and no
arrow up through its layers. Read from the source (every import statement, the ones inside
functions too), so a lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lmcache_remote"

#: Layers from the bottom, each a list of groups: the package root's entries (a module or a
#: folder, docs/architecture.md). A module may import its own group and the layers below;
#: groups of one layer do not import each other. The first four layers are the core.
LAYERS: list[list[str]] = [
    ["errors", "version"],
    ["native", "naming", "telemetry", "urls"],
    ["values"],
    ["config"],
    ["connectors", "storage"],
    ["engine", "admin"],
    ["integrations", "replay"],
]
#: Entries of the package root that are not modules of a layer.
NOT_CODE = {"__init__.py", "py.typed", "__pycache__"}


def modules() -> dict[str, Path | None]:
    """Dotted name -> source file (None for the C extension)."""
    found: dict[str, Path | None] = {"lmcache_remote.native._wire": None}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def edges() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names
                               if a.name.startswith("lmcache_remote"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if not base.startswith("lmcache_remote"):
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(resolve(full if full in mods else base))
        targets.discard(None)
        targets.discard(name)
        out[name] = {t for t in targets if t is not None}
    return out


def group(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "package"  # lmcache_remote/__init__.py: the public API, re-exports
    return parts[1]


def layer(group_name: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if group_name in names)


def test_no_import_cycle() -> None:
    graph = edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert cycles == []


def test_no_import_points_up_or_sideways() -> None:
    wrong = []
    for module, targets in edges().items():
        mine = group(module)
        if mine == "package":
            continue
        for target in targets:
            theirs = group(target)
            if theirs == mine:
                continue
            if theirs == "package" or layer(theirs) >= layer(mine):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_library_never_imports_the_cli() -> None:
    users = [str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py")
             if "lmcache_remote_cli" in path.read_text()]
    assert users == []


#: Inside `storage/`, its folders from the bottom (docs/architecture.md, the package's
#: docstring): a module may import its own folder and those below, never one above or beside.
STORAGE_LAYERS: list[list[str]] = [
    ["tier"],
    ["local"],
    ["wire"],
    ["session"],
    ["value"],
    ["keep"],
    ["chunks"],
    ["pages"],
    ["manager"],
]


def storage_group(module: str) -> str | None:
    """The folder (or root module) of `storage/` that `module` belongs to; None outside it
    and for the package itself."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "storage" else None


def test_storage_imports_run_up_its_folders() -> None:
    order = {name: i for i, names in enumerate(STORAGE_LAYERS) for name in names}
    wrong = []
    for module, targets in edges().items():
        mine = storage_group(module)
        if mine is None:
            continue
        for target in targets:
            theirs = storage_group(target)
            if target == "lmcache_remote.storage" or (
                    theirs is not None and theirs != mine and order[theirs] >= order[mine]):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_every_entry_of_storage_has_its_layer() -> None:
    placed = {name for names in STORAGE_LAYERS for name in names}
    storage = PACKAGE / "storage"
    entries = {path.stem if path.suffix == ".py" else path.name
               for path in storage.iterdir()
               if path.name not in NOT_CODE}
    assert entries == placed


def test_the_earlier_storage_paths_import_the_moved_modules() -> None:
    """Every module that sat in `storage/` before its folders still imports at its earlier
    path, as the very module of its new one (`storage.MOVED`)."""
    import importlib

    import lmcache_remote.storage as storage

    mods = modules()
    for old, new in storage.MOVED.items():
        assert f"lmcache_remote.storage.{old}" not in mods, old  # no file left behind
        alias = importlib.import_module(f"lmcache_remote.storage.{old}")
        for path in new.split():
            moved = importlib.import_module(f"lmcache_remote.storage.{path}")
            public = [n for n in vars(moved) if not n.startswith("_")]
            assert public and all(getattr(alias, n) is getattr(moved, n) for n in public), old
    # a name set at the earlier path is set on the module that holds it
    import lmcache_remote.storage.redis_commands as earlier

    from lmcache_remote.storage.wire import windows

    before = windows.WINDOW_BYTES
    try:
        earlier.WINDOW_BYTES = 123
        assert windows.WINDOW_BYTES == 123
    finally:
        windows.WINDOW_BYTES = before


def test_the_layers_are_read_right() -> None:
    """The checks above see real edges: a few this tree is known to have."""
    graph = edges()
    assert ("lmcache_remote.storage.manager.storage_manager"
            in graph["lmcache_remote.engine.cache_engine"])
    assert "lmcache_remote.native._wire" in graph["lmcache_remote.native"]
    assert "lmcache_remote.values.integrity" in graph["lmcache_remote.config"]
    assert group("lmcache_remote.integrations.vllm.connector") == "integrations"
    assert layer(group("lmcache_remote.storage.wire.bulk")) < layer(group("lmcache_remote.engine"))
    assert layer(group("lmcache_remote.values.serde")) < layer(group("lmcache_remote.config"))


def test_every_entry_of_the_package_root_has_its_layer() -> None:
    """The folder listing is the map: each module or folder at the root is one group of
    `LAYERS`, so a new one is placed in a layer (and in docs/architecture.md) when it lands."""
    placed = {name for names in LAYERS for name in names}
    entries = {path.stem if path.suffix == ".py" else path.name
               for path in PACKAGE.iterdir()
               if path.name not in NOT_CODE and path.suffix != ".so"}
    assert entries == placed


def test_the_architecture_page_lists_the_root() -> None:
    """docs/architecture.md's folder listing names every entry of the package root."""
    listing = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    named = {line.split()[0].rstrip("/").removesuffix(".py")
             for line in listing.splitlines()[1:] if line.strip()}
    assert {name for names in LAYERS for name in names} <= named


def test_the_install_ships_every_package() -> None:
    """pyproject.toml lists the packages a wheel holds (no discovery): every folder of the
    package with an `__init__.py` is one of them, so a non-editable install has each layer."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(lmcache_remote(?:\.\w+)*)"',
                            pyproject.split("packages = [", 1)[1].split("]", 1)[0]))
    folders = {".".join(path.parent.relative_to(ROOT).parts)
               for path in PACKAGE.rglob("__init__.py")}
    assert folders == listed
