"""The package's import graph: imports run one way (no cycle, counting imports inside functions
too), and the layers do not depend on the integrations."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "openmsa"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """The openmsa modules ``path`` imports, anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{alias.name}" for alias in node.names]
            found.update(name for name in [target, *names] if name in MODULES)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
    found.discard(module)
    return found


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = {module: _imports(path, module) for module, path in MODULES.items()}


def _parents(module: str) -> set[str]:
    """Packages whose ``__init__`` runs before ``module``: importing a.b.c imports a and a.b."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_the_graph_sees_the_package():
    assert "openmsa.ops.pipeline" in GRAPH["openmsa.ops.custom_ops"]
    assert "openmsa.ops.msa" in GRAPH["openmsa"]


def test_imports_have_no_cycle():
    state = {}  # module -> "open" while on the path, "done" after

    def visit(module, path):
        state[module] = "open"
        for target in sorted(GRAPH[module] - _parents(module)):
            if state.get(target) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path + [target]))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_layers_do_not_import_integrations():
    for module, targets in GRAPH.items():
        if module.startswith("openmsa.layers"):
            assert not any(t.startswith("openmsa.integrations") for t in targets), module
