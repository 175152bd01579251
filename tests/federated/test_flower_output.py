"""Flower's log lines are printed once: by the command line and by the app's processes.

Flower prints its records with its own console handler and also propagates them to
the root logger; a plain root stream handler (the command's ``basicConfig``, or the
one Opacus installs when imported) printed each a second time. Each check runs in a
process of its own: one interpreter imports torch, scipy and numpy (which set up no
logging; checked) and forks a child per check, which runs the check's code as a
fresh interpreter would (``-c``) with its stdout and stderr in a file, so the
logging setup of this test process, or of another check, plays no part. One
interpreter start for the eight checks instead of eight.
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.federated.superlink import REPO, simulation_env

FLOWER_LINES = """
import logging
from flwr.common.logger import log
log(logging.INFO, "flower-info-%s" % MARK)
log(logging.ERROR, "flower-error-%s" % MARK)
logging.getLogger("defense_suite.probe").warning("suite-warning-%s" % MARK)
"""

FORKS = """
import json, logging, os, sys, traceback
import numpy, scipy.optimize, scipy.stats, torch, torch.distributed.tensor, torch.func
root = logging.getLogger()
assert not root.handlers and not root.filters, "a preloaded module set up logging"
bodies, out = json.loads(sys.stdin.read()), {}
for name, body in bodies.items():
    path = os.path.join(sys.argv[1], name + ".txt")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = 0
        try:
            exec(compile(body, "<string>", "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            code = 1
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(path, encoding="utf-8") as f:
        out[name] = [os.waitstatus_to_exitcode(status), f.read()]
print(json.dumps(out))
"""


def _forked(bodies: dict[str, str], folder: Path) -> dict[str, str]:
    """Each body's stdout and stderr, each run in a child forked from one
    interpreter that preloaded torch, scipy and numpy (see the module)."""
    done = subprocess.run(
        [sys.executable, "-c", FORKS, str(folder)], input=json.dumps(bodies),
        capture_output=True, text=True, timeout=300, check=True, cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "FLWR_LOG_LEVEL"},
    )  # fmt: skip
    out = {}
    for name, (code, text) in json.loads(done.stdout.splitlines()[-1]).items():
        assert code == 0, (name, text)  # as check=True did for one interpreter
        out[name] = text
    return out


def _count(text: str, needle: str) -> int:
    return sum(needle in line for line in text.splitlines())


CHECKS = {
    **{
        f"command-{verbose}": (
            f"from defense_suite.logs import configure\nconfigure({verbose})\n"
            "import opacus.utils.module_utils\nMARK = 'x'\n" + FLOWER_LINES
        )
        for verbose in (0, 1, 2)
    },
    "quiet": (
        "from defense_suite.logs import configure, flower_level\n"
        "configure(0, quiet=True)\nimport os\n"
        "with flower_level(True):\n"
        "    MARK = 'in'\n"
        "    exec(compile(" + repr(FLOWER_LINES) + ", 'lines', 'exec'))\n"
        "    assert os.environ['FLWR_LOG_LEVEL'] == 'ERROR'\n"
        "assert 'FLWR_LOG_LEVEL' not in os.environ\n"
        "MARK = 'after'\n" + FLOWER_LINES
    ),
    "opacus-raw": "import opacus.utils.module_utils\nMARK = 'raw'\n" + FLOWER_LINES,
    "opacus-app": (
        "from defense_suite.federated.flower.console import flower_once\n"
        "flower_once()\nimport opacus.utils.module_utils\nflower_once()\n"
        "MARK = 'app'\n" + FLOWER_LINES
    ),
    "debug-hidden": (
        "from defense_suite.federated.flower.console import flower_once\n"
        "flower_once()\nimport logging\nimport opacus.utils.module_utils\n"
        "from flwr.common.logger import log\nlog(logging.DEBUG, 'flower-debug')\n"
        "logging.getLogger('defense_suite.probe').warning('suite-warning')\n"
    ),
    "example": (
        "from flwr.supercore.task_identity import TaskIdentity\n"
        "TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1\n"
        "from flwr.app import Context, Message, RecordDict\n"
        "from defense_suite.federated.flower import TimeAdaptiveMod\n"
        "mod = TimeAdaptiveMod(lambda context: None)\n"
        "ctx = Context(run_id=1, node_id=2, node_config={}, state=RecordDict(),"
        " run_config={})\n"
        "msg = Message(content=RecordDict(), message_type='query.other',"
        " dst_node_id=2)\n"
        "assert mod(msg, ctx, None).has_error()\n"
        "import opacus.utils.module_utils  # what make_private imports, later\n"
        "MARK = 'example'\n" + FLOWER_LINES
    ),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every check's output (one interpreter, one fork per check)."""
    return _forked(CHECKS, tmp_path_factory.mktemp("flower-output"))


@pytest.mark.parametrize("verbose", [0, 1, 2])
def test_the_command_prints_each_flower_line_once(verbose, outputs):
    out = outputs[f"command-{verbose}"]
    assert _count(out, "flower-info-x") == 1, out
    assert _count(out, "flower-error-x") == 1, out
    assert _count(out, "suite-warning-x") == 1, out  # our own records still print


def test_quiet_leaves_flower_errors_only_and_restores_flowers_level(outputs):
    out = outputs["quiet"]
    assert _count(out, "flower-info-in") == 0, out
    assert _count(out, "flower-error-in") == 1, out
    assert _count(out, "suite-warning-in") == 0, out  # --quiet: errors only
    assert _count(out, "flower-info-after") == 1, out  # Flower's INFO again


def test_a_user_flower_level_is_kept_under_quiet(monkeypatch):
    from defense_suite.logs import flower_level

    monkeypatch.setenv("FLWR_LOG_LEVEL", "DEBUG")
    with flower_level(True):
        assert os.environ["FLWR_LOG_LEVEL"] == "DEBUG"
    assert os.environ["FLWR_LOG_LEVEL"] == "DEBUG"


def test_opacus_import_doubles_flower_lines_unless_the_app_filters_them(outputs):
    raw = outputs["opacus-raw"]
    assert _count(raw, "flower-info-raw") == 2, raw  # the defect this guards
    fixed = outputs["opacus-app"]
    assert _count(fixed, "flower-info-app") == 1, fixed
    assert _count(fixed, "flower-error-app") == 1, fixed
    assert _count(fixed, "suite-warning-app") == 1, fixed
    assert "DEBUG" not in fixed  # Flower's DEBUG lines stay hidden, as Flower sets


def test_flower_debug_lines_stay_hidden_when_opacus_comes_first(outputs):
    out = outputs["debug-hidden"]
    assert "flower-debug" not in out, out
    assert _count(out, "WARNING defense_suite.probe: suite-warning") == 1, out


def test_capture_and_file_handlers_keep_flowers_records(tmp_path):
    import logging

    from defense_suite.federated.flower.console import filter_root_streams

    root = logging.getLogger()
    file_handler = logging.FileHandler(tmp_path / "log.txt")
    root.addHandler(file_handler)
    try:
        filter_root_streams()
        assert file_handler.filters == []
    finally:
        root.removeHandler(file_handler)
        file_handler.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_flwr_run_prints_each_flower_line_once(tmp_path):
    env = simulation_env(
        tmp_path, 2, 39391, DEFENSE_SUITE_STATE_DIR=str(tmp_path / "ledgers")
    )
    env.pop("FLWR_LOG_LEVEL", None)
    command = [sys.executable, "-m", "defense_suite", "federated", "run",
               str(REPO), "--run-config", "num-server-rounds=2"]  # fmt: skip
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=800, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    spent = [line for line in out.splitlines() if "spent epsilon" in line]
    assert len(spent) == 4, out[-4000:]  # 2 rounds x 2 clients, each once
    counts = Counter(line.split("spent epsilon")[0] for line in spent)
    assert set(counts.values()) == {1}, spent
    once = ["Starting TimeAdaptiveStrategy", "Initial global evaluation", "[ROUND 2/2]"]
    for text in once:
        assert _count(out, text) == 1, (text, out[-4000:])
    assert ":INFO:" not in out  # no line in Opacus's basicConfig format
    assert ":DEBUG:" not in out  # nor Flower's DEBUG lines (its handler hides them)


def test_the_example_apps_pieces_print_flowers_lines_once(outputs):
    """Issue 40: the example app (mod + wrapper, no call of its own) ran Opacus's
    basicConfig first; the mod and the wrapper now install the filter themselves."""
    out = outputs["example"]
    assert _count(out, "flower-info-example") == 1, out
    assert _count(out, "flower-error-example") == 1, out
    assert _count(out, "suite-warning-example") == 1, out
