"""The layout rules of docs/suite.md that a reviewer would otherwise check by hand."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("defenses", "federated", "crypto", "defense_suite")
LIMIT = 450


def modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_symlink() or any(p.is_symlink() for p in path.parents):
                continue
            yield path


def test_no_module_is_longer_than_the_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in modules()
        if (n := len(p.read_text().splitlines())) > LIMIT
    }
    assert not long, f"modules over {LIMIT} lines: {long}"


def test_no_catch_all_helper_files():
    names = {p.name for p in modules()}
    assert not names & {"_util.py", "util.py", "utils.py", "helpers.py", "misc.py"}


def _imports(path: Path) -> set[str]:
    """Every module the file imports at run time, at the top or inside a function.

    Imports under ``if TYPE_CHECKING:`` are annotations only, not dependencies.
    """
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_no_import_cycle_between_modules():
    graph = {}
    for path in modules():
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        graph[name] = _imports(path)
    known = set(graph)
    edges = {m: {d for d in deps if d in known and d != m} for m, deps in graph.items()}
    packages = {
        m for m in known if (ROOT / m.replace(".", "/") / "__init__.py").exists()
    }

    def visit(node, stack, done):
        stack.append(node)
        for nxt in edges[node]:
            if nxt in packages and node.startswith(nxt + "."):
                continue  # a package's __init__ re-exporting its modules
            if nxt in stack:
                raise AssertionError(f"import cycle: {' -> '.join([*stack, nxt])}")
            if nxt not in done:
                visit(nxt, stack, done)
        stack.pop()
        done.add(node)

    done = set()
    for module in sorted(edges):
        if module not in done:
            visit(module, [], done)


CRYPTO_ROOT = {
    "__init__.py",
    "arms.py",
    "attacks.py",
    "defense.py",
    "figures.py",
    "scenario.py",
    "tasks.py",
}
"""The files every package of the suite has; everything else lives in a layer."""
CRYPTO_LAYERS = {"he": 1, "models": 2, "conversion": 3, "program": 4, "protocol": 5}
"""Issue 41's layers, bottom to top: each imports only those below it (and itself)."""


def test_the_crypto_root_holds_only_the_common_files_and_the_layers():
    root = ROOT / "crypto"
    assert {p.name for p in root.glob("*.py")} == CRYPTO_ROOT
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    assert packages == {*CRYPTO_LAYERS, "benchmark"}


def test_no_crypto_module_is_named_after_a_model_family():
    """A model family is a value, not a file prefix (``bert_*``, ``*_bert``)."""
    named = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "crypto").rglob("*.py")
        if "bert_" in p.stem or p.stem.endswith("_bert")
    ]
    assert not named, named


def _crypto_layer(module: str) -> int:
    """A crypto module's layer: 0 for ``tasks`` (data), 6 for the root's harness."""
    parts = module.split(".")
    if parts[0] != "crypto" or len(parts) == 1:
        return -1
    if parts[1] == "tasks":
        return 0
    return CRYPTO_LAYERS.get(parts[1], 6)


def test_each_crypto_layer_imports_only_the_layers_below_it():
    """The program does not know the protocol, the backend knows no model, ...

    Run-time imports only (``TYPE_CHECKING`` blocks are annotations).
    """
    upward = []
    for path in (ROOT / "crypto").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        layer = _crypto_layer(name)
        for imported in _imports(path):
            if _crypto_layer(imported) > layer:
                upward.append(f"{name} -> {imported}")
    assert not upward, sorted(upward)
