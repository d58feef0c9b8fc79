"""The import graph of the repository's own modules, read from their source (imports inside functions
included, those under `if TYPE_CHECKING:` left out: they never run): no circle anywhere, and data flows one
way between packages."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "data", "training", "serving", "evaluation")
TOP_MODULES = ("typed_config", "loading", "train", "generate")
# what each package (and the loading module) may import of the others and of the top-level modules
ALLOWED = {
    "models": {"typed_config"},
    "data": {"models", "typed_config"},
    "loading": {"models", "data", "typed_config"},
    "serving": {"models", "data", "loading", "typed_config"},
    "training": {"models", "data", "loading", "typed_config"},
    "evaluation": {"models", "data", "loading", "serving", "training", "typed_config"},
}


def _modules() -> dict[str, Path]:
    found = {name: ROOT / f"{name}.py" for name in TOP_MODULES}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


MODULES = _modules()


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those inside an `if TYPE_CHECKING:` block."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (child for orelse in node.orelse for child in [orelse, *_runtime_nodes(orelse)])
            continue
        yield node
        yield from _runtime_nodes(node)


def imports(name: str) -> set[str]:
    """The repository modules `name` imports: `from package import thing` counts as the submodule where
    `thing` is one, else as the package's __init__."""
    found = set()
    for node in _runtime_nodes(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
            targets = [t if t in MODULES else node.module for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imports(name) for name in MODULES}


def test_the_walk_sees_imports_inside_functions():
    assert "models.idefics3" in GRAPH["models.lora"]  # imported inside _our_key only
    assert {"models", "data", "serving"} <= {n.split(".")[0] for n in GRAPH["generate"]}


def test_no_module_imports_itself_round_a_circle():
    circles = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(GRAPH[name]):
            if state.get(target) == "open":
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)


@pytest.mark.parametrize("package", ALLOWED)
def test_a_package_imports_only_the_layers_below_it(package):
    crossing = {f"{name} -> {target}" for name in GRAPH if name.split(".")[0] == package
                for target in GRAPH[name] if target.split(".")[0] not in ALLOWED[package] | {package}}
    assert not crossing, sorted(crossing)
