"""Flower's log lines are printed once: by the command line and by the app's processes.

Flower prints its records with its own console handler and also propagates them to
the root logger; a plain root stream handler (the command's ``basicConfig``, or the
one Opacus installs when imported) printed each a second time. Each check runs in a
fresh interpreter, so the logging setup of this test process plays no part.
"""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FLOWER_LINES = """
import logging
from flwr.common.logger import log
log(logging.INFO, "flower-info-%s" % MARK)
log(logging.ERROR, "flower-error-%s" % MARK)
logging.getLogger("defense_suite.probe").warning("suite-warning-%s" % MARK)
"""


def _stderr(body: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", body],
        capture_output=True, text=True, timeout=120, check=True, cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "FLWR_LOG_LEVEL"},
    )  # fmt: skip
    return done.stdout + done.stderr


def _count(text: str, needle: str) -> int:
    return sum(needle in line for line in text.splitlines())


@pytest.mark.parametrize("verbose", [0, 1, 2])
def test_the_command_prints_each_flower_line_once(verbose):
    out = _stderr(
        f"from defense_suite.logs import configure\nconfigure({verbose})\n"
        "import opacus.utils.module_utils\nMARK = 'x'\n" + FLOWER_LINES
    )
    assert _count(out, "flower-info-x") == 1, out
    assert _count(out, "flower-error-x") == 1, out
    assert _count(out, "suite-warning-x") == 1, out  # our own records still print


def test_quiet_leaves_flower_errors_only_and_restores_flowers_level():
    out = _stderr(
        "from defense_suite.logs import configure, flower_level\n"
        "configure(0, quiet=True)\nimport os\n"
        "with flower_level(True):\n"
        "    MARK = 'in'\n"
        "    exec(compile(" + repr(FLOWER_LINES) + ", 'lines', 'exec'))\n"
        "    assert os.environ['FLWR_LOG_LEVEL'] == 'ERROR'\n"
        "assert 'FLWR_LOG_LEVEL' not in os.environ\n"
        "MARK = 'after'\n" + FLOWER_LINES
    )
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


def test_opacus_import_doubles_flower_lines_unless_the_app_filters_them():
    body = "import opacus.utils.module_utils\nMARK = 'raw'\n" + FLOWER_LINES
    raw = _stderr(body)
    assert _count(raw, "flower-info-raw") == 2, raw  # the defect this guards
    fixed = _stderr(
        "from defense_suite.federated.flower.console import flower_once\n"
        "flower_once()\nimport opacus.utils.module_utils\nflower_once()\n"
        "MARK = 'app'\n" + FLOWER_LINES
    )
    assert _count(fixed, "flower-info-app") == 1, fixed
    assert _count(fixed, "flower-error-app") == 1, fixed
    assert _count(fixed, "suite-warning-app") == 1, fixed
    assert "DEBUG" not in fixed  # Flower's DEBUG lines stay hidden, as Flower sets


def test_flower_debug_lines_stay_hidden_when_opacus_comes_first():
    out = _stderr(
        "from defense_suite.federated.flower.console import flower_once\n"
        "flower_once()\nimport logging\nimport opacus.utils.module_utils\n"
        "from flwr.common.logger import log\nlog(logging.DEBUG, 'flower-debug')\n"
        "logging.getLogger('defense_suite.probe').warning('suite-warning')\n"
    )
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
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
        "options.num-supernodes = 2\n"
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "DEFENSE_SUITE_STATE_DIR": str(tmp_path / "ledgers"),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39391",
        "FLWR_LOCAL_CONTROL_API_PORT": "39393",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
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


def test_the_example_apps_pieces_print_flowers_lines_once():
    """Issue 40: the example app (mod + wrapper, no call of its own) ran Opacus's
    basicConfig first; the mod and the wrapper now install the filter themselves."""
    out = _stderr(
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
    )
    assert _count(out, "flower-info-example") == 1, out
    assert _count(out, "flower-error-example") == 1, out
    assert _count(out, "suite-warning-example") == 1, out
