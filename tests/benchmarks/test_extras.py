"""A component whose extra is missing is refused with its pip line, never mid-run."""

import ast
import inspect
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from defense_suite.extras import (
    EXTRAS,
    MissingExtra,
    explain_import_error,
    extras_of,
    install_line,
    missing_modules,
    require_for,
)
from defenses.registry import KINDS, available, load

REPO = Path(__file__).resolve().parents[2]
SPECS = REPO / "benchmarks" / "specs"


def _blocked(modules, argv, cwd):
    """Run the CLI in a fresh interpreter in which ``modules`` cannot be imported.

    ``sys.modules[name] = None`` is how Python itself marks a module as absent: any
    ``import name`` raises ModuleNotFoundError, as on an install without the extra.
    """
    code = (
        "import sys\n"
        f"for name in {list(modules)!r}:\n"
        "    sys.modules[name] = None\n"
        "from defense_suite.cli import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_install_line_names_the_distribution_and_every_extra():
    assert install_line(["crypto", "art", "art"]) == (
        "pip install 'defense-suite[art,crypto]'"
    )


def test_pyproject_extras_provide_the_import_names_and_all_holds_them():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)
    (everything,) = extras["all"]
    listed = set(re.fullmatch(r"defense-suite\[(.*)\]", everything)[1].split(","))
    assert listed >= set(EXTRAS)  # [all] installs every extra a component needs
    owners = packages_distributions()
    for extra, modules in EXTRAS.items():
        wanted = {
            re.split(r"[\[<>=!; ]", r, maxsplit=1)[0].lower().replace("_", "-")
            for r in extras[extra]
        }
        for module in modules:
            found = {d.lower().replace("_", "-") for d in owners.get(module, [])}
            assert found & wanted, (extra, module, found, wanted)


def test_torch_is_in_no_extra():
    """The CPU build is installed first; no extra may ask pip for another torch."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for name, requirements in extras.items():
        assert not any(r.startswith("torch") for r in requirements), name


_OPTIONAL = re.compile(
    r"^\s*(?:from|import)\s+(art|flwr|opacus|tenseal)\b", re.M
)  # libraries a component cannot run without (pandas, hypothesis: only on request)
_EXTRA_OF = {"art": "art", "flwr": "federated", "opacus": "federated"}
_EXTRA_OF["tenseal"] = "crypto"


def _reach(component):
    """The source a component runs: its module's top-level imports, its own code
    and the code of the module-level functions it calls by name (one level)."""
    module = inspect.getmodule(component)
    tree = ast.parse(inspect.getsource(module))
    top = [
        ast.unparse(node)
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    own = inspect.getsource(component)
    called = set(re.findall(r"\b(\w+)\(", own))
    helpers = [
        ast.unparse(node)
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in called
    ]
    return "\n".join([*top, own, *helpers])


def test_every_component_importing_an_optional_library_declares_its_extra():
    uncovered = []
    for kind in KINDS:
        if kind == "figures":
            continue
        for name in available(kind):
            source = _reach(load(kind, name))
            for library in set(_OPTIONAL.findall(source)):
                if _EXTRA_OF[library] not in extras_of(name):
                    uncovered.append((kind, name, library))
    assert uncovered == []


def test_require_for_names_where_each_component_and_the_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "art", None)
    assert missing_modules("art") == ["art"]
    with pytest.raises(MissingExtra) as caught:
        require_for(["ssd-shield", "ssd-art-rounded", "ssd-art-rounded"], "spec x")
    message = str(caught.value)
    assert message.startswith("spec x: ssd-art-rounded need(s) art")
    assert "ssd-shield" not in message
    assert message.endswith("run: pip install 'defense-suite[art]'")
    require_for(["ssd-shield", "none-such"], "spec y")  # nothing missing: no error
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        missing_modules("gpu")


def test_a_spec_whose_extra_is_missing_is_refused_before_the_first_game(tmp_path):
    out = tmp_path / "ssd.jsonl"
    done = _blocked(
        ["art"], ["run", str(SPECS / "ssd-quick.toml"), "--out", str(out)], tmp_path
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "ssd-art-gaussian-noise" in done.stderr
    assert "run: pip install 'defense-suite[art]'" in done.stderr
    assert not out.exists()


def test_an_import_error_of_an_optional_library_is_explained_with_its_line():
    try:
        try:
            raise ModuleNotFoundError("No module named 'tenseal'", name="tenseal")
        except ModuleNotFoundError as inner:
            raise ImportError("could not load the plugin module") from inner
    except ImportError as outer:
        message = explain_import_error(outer)
    assert message == (
        "tenseal is not installed (extra 'crypto'); run: "
        "pip install 'defense-suite[crypto]'"
    )
    plain = ModuleNotFoundError("No module named 'nonesuch'", name="nonesuch")
    assert explain_import_error(plain) is None
    assert explain_import_error(ImportError("cannot import name x")) is None


def test_list_without_tenseal_and_flower_marks_exactly_what_cannot_run(tmp_path):
    """One fresh interpreter without tenseal, flwr and opacus (one discovery for
    what took three).

    Discovery leaves out a built-in package whose optional library is missing
    (docs/suite.md), and only that one: the Flower app is the one module not
    loaded, named with the library it lacks and its pip line; every other component
    is listed, and exactly those whose extra lacks tenseal (crypto) or flwr and
    opacus (federated) are marked, each with its own pip line.
    """
    done = _blocked(["tenseal", "flwr", "opacus"], ["list", "--components"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    not_loaded = [line for line in done.stdout.splitlines() if "not loaded" in line]
    assert not_loaded == [
        "not loaded: defense_suite.federated.flower (no module 'flwr': "
        "pip install 'defense-suite[federated]')"
    ], done.stdout
    assert "  ssd-digits\n" in done.stdout
    lines = done.stdout.splitlines()
    assert "  ssd-shield" in lines
    listed = [line.split()[0] for line in lines if line.startswith("  ")]
    marked = {line.split()[0]: line for line in lines if "not installed" in line}
    assert {"crypto-ckks", "crypto-private-inference"} <= set(marked)
    assert any(name.startswith("federated-") for name in marked)
    lacking = {"crypto", "federated"}
    assert set(marked) == {n for n in listed if lacking & set(extras_of(n))}
    for name, line in marked.items():
        extras = sorted(lacking & set(extras_of(name)))
        assert line.endswith(f"(not installed: {install_line(extras)})"), line
