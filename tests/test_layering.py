"""The import graph: capture/ is a library (nothing from graphexec), and no package has import
cycles among its modules' top-level imports.  Imports under TYPE_CHECKING are edges too (a type
named across rooms is a dependency as real as a call); imports inside functions are deliberate late
bindings (heavy optional libraries) and are not."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("capture", "graphexec")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> set[str]:
    """Modules imported at module level, `if TYPE_CHECKING:` blocks included (not in functions)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(getattr(node, "body", []))
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _top_level_imports(path) if m in modules and m != name}
    return graph


def test_capture_imports_nothing_from_graphexec():
    arrows = sorted(
        (name, target) for name, targets in _graph().items() if name.startswith("capture")
        for target in targets if target.split(".")[0] == "graphexec"
    )
    assert arrows == []
    # Function-level imports count here too: a library does not reach back into its caller.
    for path in (ROOT / "capture").rglob("*.py"):
        assert "graphexec" not in {
            n.module.split(".")[0] for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.module
        }, path


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            connect(node)
    return found


def test_no_import_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the detector works
    assert _cycles(_graph()) == []


def _room(module: str) -> str:
    """A module's room: capture, or graphexec's subpackage (engine, scheduler, cache, runner,
    attention, ...) or top-level module (config, sampling_params, ...)."""
    parts = module.split(".")
    return parts[0] if parts[0] == "capture" else ".".join(parts[:2])


def test_no_import_cycles_between_rooms():
    """Calls go down (docs/ARCHITECTURE.md): no two rooms import each other, even through
    different modules (models/checkpoint.py ↔ loader, attention ↔ runner's forward context and
    config ↔ runner's ForwardMode were such cycles)."""
    rooms: dict[str, set[str]] = {}
    for name, targets in _graph().items():
        rooms.setdefault(_room(name), set()).update(_room(t) for t in targets if _room(t) != _room(name))
    assert _cycles(rooms) == []


def test_the_batch_vocabulary_is_at_the_bottom():
    """graphexec/batch/ (Req, ScheduleBatch, ForwardBatch, ForwardMode, padding) is what every room
    speaks, so it may lean only on capture/ and the rooms below it, never on a room that uses it."""
    allowed = {"capture", "graphexec.batch", "graphexec.sampling", "graphexec.structured",
               "graphexec.sampling_params", "graphexec.errors", "graphexec.lazy_exports"}
    leans_on = {_room(t) for name, targets in _graph().items() if _room(name) == "graphexec.batch" for t in targets}
    assert leans_on <= allowed, leans_on - allowed


# The room order docs/ARCHITECTURE.md draws, bottom floor first: a room imports only rooms on lower
# floors (TYPE_CHECKING imports included), and every room has a floor.
FLOORS = (
    ("capture", "graphexec.errors", "graphexec.lazy_exports"),
    ("graphexec", "graphexec.kernels", "graphexec.text"),
    ("graphexec.quant", "graphexec.structured"),
    ("graphexec.sampling_params",),
    ("graphexec.sampling",),
    ("graphexec.batch",),
    ("graphexec.config",),
    ("graphexec.cache", "graphexec.parallel"),
    ("graphexec.attention",),
    ("graphexec.models",),
    ("graphexec.loader",),
    ("graphexec.runner",),
    ("graphexec.speculative",),
    ("graphexec.scheduler",),
    ("graphexec.engine",),
    ("graphexec.server", "graphexec.entrypoints"),
)


def _shown(room: str) -> str:
    """A room as the floors block of docs/ARCHITECTURE.md names it."""
    if room == "capture":
        return "capture/"
    if room == "graphexec":
        return "__init__.py"
    name = room.partition(".")[2]
    return f"{name}/" if (ROOT / "graphexec" / name).is_dir() else f"{name}.py"


def test_rooms_import_only_rooms_on_lower_floors():
    floor = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}
    upward = set()
    for name, targets in _graph().items():
        assert _room(name) in floor, f"{_room(name)} has no floor in FLOORS (and docs/ARCHITECTURE.md)"
        upward |= {(_room(name), _room(t)) for t in targets if _room(t) != _room(name) and floor[_room(t)] >= floor[_room(name)]}
    assert upward == set(), "imports sideways or up the floors of docs/ARCHITECTURE.md"
    # The document draws the same floors.
    documented = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for level, rooms in enumerate(FLOORS):
        line = f"floor {level:>2}  " + "  ".join(_shown(r) for r in rooms)
        assert line in documented, f"docs/ARCHITECTURE.md lacks the line {line!r}"


# Private names another module still reaches, each with its reason; the list only shrinks.
PRIVATE_ACCESS_ALLOWED: set[tuple[str, str]] = set()


def _private_names_defined() -> set[str]:
    """`_name`s our own code defines: functions, methods, classes, names and attributes it assigns."""
    names = set()
    for pkg in (*PACKAGES, "bench"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)  # module constants (`module._LIMIT`)
    return {n for n in names if n.startswith("_") and not n.startswith("__") and n != "_"}


def test_no_module_reaches_another_objects_private_names():
    """`obj._name` on anything but self/cls/super() is a reach into another object's insides
    (tests are exempt: they check invariants from the inside)."""
    ours = _private_names_defined()
    found = set()
    for pkg in (*PACKAGES, "bench"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Attribute) and node.attr in ours):
                    continue
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                    continue
                found.add((str(path.relative_to(ROOT)), node.attr))
    assert found - PRIVATE_ACCESS_ALLOWED == set()
    assert PRIVATE_ACCESS_ALLOWED <= found, "an allowed access is gone: drop it from the list"
