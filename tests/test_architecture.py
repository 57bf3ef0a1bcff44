"""The floor plan's rules, checked on the source (docs/architecture.md draws them).

Every import in ``hetpipe/`` is parsed with ``ast`` (function-local ones included) and
checked against five rules: no cycles between modules; layers only import downwards;
no ``_private`` name imported from another module; no file over 500 lines; no function
over 60 lines. ``hetpipe/__init__.py`` re-exports the public API lazily and is exempt.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "hetpipe"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60

# Bottom to top: a module may import its own layer or any layer below, never one above.
# `models` (the zoo and the `package.module:factory` loader) is a library of nn.Modules
# that capture and the runtime both build from; it imports only `errors`, so it sits
# just above `errors`, below everything that consumes a model.
LAYERS: tuple[str, ...] = (
    "errors",
    "models",
    "cost_models",
    "schedule",
    "partitioner",
    "plan",
    "runtime",
    "cli",
)


@dataclass(frozen=True)
class ImportEdge:
    """One `import` statement's target as seen from a module of the package."""

    source: str  # dotted module name, e.g. "hetpipe.plan.build"
    target: str  # dotted module (or module.attribute) name imported
    names: tuple[str, ...]  # names taken with `from target import ...`
    line: int


def module_name(path: Path) -> str:
    """`hetpipe/plan/build.py` -> `hetpipe.plan.build` (a package is its `__init__`)."""
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def all_modules() -> set[str]:
    return {module_name(p) for p in source_files()}


def resolve_relative(source: str, is_package: bool, level: int, module: str | None) -> str:
    base = source.split(".") if is_package else source.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(path: Path) -> list[ImportEdge]:
    """Every import in the file, at any depth (module level, functions, TYPE_CHECKING)."""
    source = module_name(path)
    edges: list[ImportEdge] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            edges += [ImportEdge(source, a.name, (), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                target = resolve_relative(source, path.name == "__init__.py", node.level, node.module)
            names = tuple(a.name for a in node.names)
            edges.append(ImportEdge(source, target, names, node.lineno))
    return edges


def internal_targets(edge: ImportEdge, modules: set[str]) -> set[str]:
    """The package modules an import loads: `from hetpipe.plan import schema` loads
    `hetpipe.plan.schema`; `from hetpipe.plan.schema import Plan` loads `hetpipe.plan.schema`."""
    if not edge.target.startswith("hetpipe"):
        return set()
    found = {f"{edge.target}.{n}" for n in edge.names if f"{edge.target}.{n}" in modules}
    if edge.target in modules and (not edge.names or len(found) < len(edge.names)):
        found.add(edge.target)
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (packages' `__init__` included)."""
    modules = all_modules()
    deps: dict[str, set[str]] = {m: set() for m in modules}
    for path in source_files():
        for edge in imports_of(path):
            deps[edge.source] |= internal_targets(edge, modules) - {edge.source}
    return deps


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # hetpipe/__init__.py: the lazy re-export, exempt
    return parts[1].removesuffix(".py")


def find_cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(deps):
        if root in index:
            continue
        work = [(root, iter(sorted(deps[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(deps.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_parser_sees_function_local_imports(tmp_path: Path) -> None:
    """The checker itself: an import inside a function body is found."""
    sample = PACKAGE_DIR / "cli" / "app.py"
    local = [e for e in imports_of(sample) if e.target.startswith("hetpipe")]
    assert local, "the CLI imports the package; the parser found nothing"
    deps = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(deps) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    deps = {m: {t for t in ts if t != "hetpipe"} for m, ts in graph().items() if m != "hetpipe"}
    cycles = find_cycles(deps)
    assert not cycles, "modules importing each other in a circle:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_layers_import_downwards() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    back_arrows = []
    for module, targets in graph().items():
        src = layer_of(module)
        if src is None:
            continue
        assert src in rank, f"{module}: layer {src!r} is not in LAYERS; add it to the rule"
        for target in targets:
            dst = layer_of(target)
            if dst is None:
                back_arrows.append(f"{module} -> hetpipe (import the defining module instead)")
            elif rank[dst] > rank[src]:
                back_arrows.append(f"{module} ({src}) -> {target} ({dst})")
    assert not back_arrows, "imports pointing up the layers:\n" + "\n".join(sorted(back_arrows))


def test_no_private_names_across_modules() -> None:
    modules = all_modules()
    leaks = []
    for path in source_files():
        for edge in imports_of(path):
            if not edge.target.startswith("hetpipe") or edge.target == edge.source:
                continue
            for name in edge.names:
                if name.startswith("_") and f"{edge.target}.{name}" not in modules:
                    leaks.append(f"{edge.source}:{edge.line} imports {edge.target}.{name}")
            private_module = [p for p in edge.target.split(".") if p.startswith("_")]
            if private_module and not edge.source.startswith(edge.target.rsplit(".", 1)[0]):
                leaks.append(f"{edge.source}:{edge.line} imports private module {edge.target}")
    assert not leaks, "private names used outside their module:\n" + "\n".join(sorted(leaks))


def test_no_private_attribute_of_another_module() -> None:
    """`from hetpipe.runtime import worker; worker._barrier()` is the same leak by another road."""
    modules = all_modules()
    leaks = []
    for path in source_files():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for edge in imports_of(path):
            for name in edge.names:
                if f"{edge.target}.{name}" in modules:
                    aliases[name] = f"{edge.target}.{name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                leaks.append(f"{module_name(path)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not leaks, "private names used outside their module:\n" + "\n".join(sorted(leaks))


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(PACKAGE_DIR)))
def test_file_and_function_sizes(path: Path) -> None:
    lines = path.read_text().count("\n")
    assert lines <= MAX_FILE_LINES, f"{path.name}: {lines} lines > {MAX_FILE_LINES}; split it"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_schedule_layer_is_torch_free() -> None:
    """`schedule/` (actions, builders, validator, simulator) and what it imports never load torch:
    the planner and the plan views simulate without it."""
    deps = graph()
    seen, todo = set(), [m for m in deps if m.startswith("hetpipe.schedule")]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += deps[module]
    heavy = []
    for path in source_files():
        if module_name(path) in seen:
            heavy += [f"{e.source}:{e.line} imports {e.target}" for e in imports_of(path)
                      if e.target.split(".")[0] == "torch"]
    assert not heavy, "torch imported under schedule/:\n" + "\n".join(heavy)
