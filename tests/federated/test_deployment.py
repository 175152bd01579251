"""The deployment engine on loopback: TLS, authenticated SuperNodes, nothing installed.

A SuperLink and three SuperNodes run as separate processes with certificates and
keys generated here; each SuperNode has its own node config (partition and budget).
The example app (a user's CNN) runs 3 rounds through ``python -m
defense_suite.federated run``; a fourth SuperNode whose key was never registered is
refused.
"""

import datetime
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flower-own-model"
BIN = Path(sys.executable).parent
BUDGETS = (1.0, 3.0, 8.0)
AGREEMENT = (
    'delta=1e-5 rounds=3 local-steps=4 sigma=1.0 spending="time-adaptive" '
    'save-fraction=0.5 save-ratio=0.7 accountant="rdp" '
    "data-seed=0 public-num-examples=400"
)
"""Each SuperNode's own privacy agreement and data (a deployment reads no run
config): its public record count and the seed of its partition and public split."""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tls(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def pem(key):
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("test CA"))
        .issuer_name(name("test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem",
             "key": folder / "server.key"}  # fmt: skip
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(pem(key))
    return paths


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's EC key pair in OpenSSH format (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    )
    return private, public


def _wait_for(path: Path, text: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a fresh ClientApp process per message, 12 in all
def test_tls_deployment_with_authenticated_supernodes(tmp_path):
    tls = make_tls(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    port, health = _free_port(), _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
        f'address = "127.0.0.1:{port}"\nroot-certificates = "{tls["ca"]}"\n'
    )
    result = tmp_path / "result.json"
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FEDERATED_RESULT_PATH": str(result),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    procs: list[subprocess.Popen] = []
    logs: dict[str, Path] = {}

    def start(name, command):
        logs[name] = tmp_path / f"{name}.log"
        out = logs[name].open("w")
        procs.append(
            subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        )
        return procs[-1]

    try:
        start("superlink", [
            str(BIN / "flower-superlink"),
            "--ssl-ca-certfile", str(tls["ca"]),
            "--ssl-certfile", str(tls["cert"]),
            "--ssl-keyfile", str(tls["key"]),
            "--enable-supernode-auth",
            "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1", "--port", str(port),
            "--health-server-address", f"127.0.0.1:{health}",
        ])  # fmt: skip
        time.sleep(8)
        keys = [make_node_key(tmp_path, f"node{i}") for i in range(4)]
        for _, public in keys[:3]:
            done = subprocess.run(
                [str(BIN / "flwr"), "supernode", "register", str(public), "test"],
                env=env, capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
        for i, (private, _) in enumerate(keys):
            start(f"supernode{i}", [
                str(BIN / "flower-supernode"),
                "--superlink", f"127.0.0.1:{port}",
                "--root-certificates", str(tls["ca"]),
                "--auth-supernode-private-key", str(private),
                "--host", "127.0.0.1", "--port", str(_free_port()),
                "--max-retries", "3",
                "--node-config",
                f"partition-id={min(i, 2)} num-partitions=3 "
                f"epsilon={BUDGETS[min(i, 2)]} {AGREEMENT} ledger-init=true "
                f'ledger-path="{tmp_path}/ledger-{i}.json"',
            ])  # fmt: skip
        run = subprocess.run(
            [sys.executable, "-m", "defense_suite.federated", "run", str(EXAMPLE),
             "test", "--run-config", "num-server-rounds=3"],
            env=env, capture_output=True, text=True, timeout=2200, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert "finished:completed" in run.stdout
        assert "uv sync" not in run.stdout
        summary = json.loads(result.read_text())
        rows = sorted(summary["clients"], key=lambda r: r["client"])
        assert [r["budget"] for r in rows] == list(BUDGETS)
        for row in rows:
            assert 0.99 * row["budget"] <= row["epsilon"] <= row["budget"]
        for rnd in (1, 2, 3):
            assert f"round {rnd}: client 2 spent epsilon" in run.stdout
        # the fourth SuperNode's key was never registered: refused, not a client
        assert len(rows) == 3
        # every node's lifetime ledger is on its own disk, charged 3 rounds
        for i in range(3):
            ledger = json.loads((tmp_path / f"ledger-{i}.json").read_text())
            assert [g["round"] for g in ledger["grants"]] == [1, 2, 3]
        # a second run on the same SuperNodes: refused, the budget is spent
        again = subprocess.run(
            [sys.executable, "-m", "defense_suite.federated", "run", str(EXAMPLE),
             "test", "--run-config", "num-server-rounds=3"],
            env=env, capture_output=True, text=True, timeout=1200, check=False,
        )  # fmt: skip
        assert again.returncode == 1
        assert "refused: over-budget" in again.stdout
        text = logs["supernode3"].read_text(errors="replace")
        assert "Failed to activate SuperNode" in text  # Flower's exit code 305
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_supernodes_with_trusted_entities_refuse_a_local_fab(tmp_path):
    """Flower's FAB verification needs the app hub: a local app is refused.

    Two SuperNodes started with ``--trusted-entities`` (an Ed25519 key) refuse the
    FAB of a local ``flwr run`` before any ClientApp code runs (Flower 1.42 wants a
    ``valid_license`` verification that only a hub-backed SuperLink adds). This is
    why docs/federated.md assumes the node runs ClientApp code it trusts.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    public = ed25519.Ed25519PrivateKey.generate().public_key()
    openssh = public.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()
    trusted = tmp_path / "trusted.yaml"
    trusted.write_text(f'publisher-key: "{openssh}"\n')
    home = tmp_path / "home"
    home.mkdir()
    port, health = _free_port(), _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        log = (tmp_path / "superlink.log").open("w")
        procs.append(subprocess.Popen([
            str(BIN / "flower-superlink"), "--insecure",
            "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1", "--port", str(port),
            "--health-server-address", f"127.0.0.1:{health}",
        ], env=env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        time.sleep(8)
        for i in range(2):
            logs.append(tmp_path / f"supernode{i}.log")
            out = logs[-1].open("w")
            procs.append(subprocess.Popen([
                str(BIN / "flower-supernode"), "--insecure",
                "--superlink", f"127.0.0.1:{port}",
                "--host", "127.0.0.1", "--port", str(_free_port()),
                "--trusted-entities", str(trusted),
                "--node-config",
                f"partition-id={i} num-partitions=3 epsilon={BUDGETS[i]} "
                f'{AGREEMENT} ledger-init=true ledger-path="{tmp_path}/l{i}.json"',
            ], env=env, stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
        run = subprocess.run(
            [sys.executable, "-m", "defense_suite.federated", "run", str(EXAMPLE),
             "test", "--run-config", "num-server-rounds=3"],
            env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert run.returncode == 1, run.stdout[-3000:]
        text = " ".join(p.read_text(errors="replace") for p in logs)
        assert "App verification is not supported by the connected SuperLink" in text
        assert not list(tmp_path.glob("l*.json"))  # no ClientApp code ever ran
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


MALICIOUS_SERVER = '''"""A malicious ServerApp in the FAB: round 1 twice per node."""

import json
import os
import time
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg

from defense_suite.federated.flower import TimeAdaptiveStrategy, records

from .task import SmallCNN

app = ServerApp()


@app.main()
def main(grid, context):
    nodes = []
    for _ in range(600):
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= 2:
            break
        time.sleep(0.5)
    strategy = TimeAdaptiveStrategy(FedAvg(), timeout=900)
    strategy._discover(grid, nodes)
    batch = []
    for node in nodes:
        own = strategy.clients[node].schedule.rounds[0]
        for _ in range(2):
            cfg = ConfigRecord({records.ROUND: 1, records.RATE: own.rate,
                                records.SIGMA: own.sigma, records.STEPS: own.steps})
            content = RecordDict({"arrays": ArrayRecord(SmallCNN().state_dict()),
                                  "config": cfg})
            batch.append(Message(content=content, message_type="train",
                                 dst_node_id=node))
    replies = grid.send_and_receive(batch, timeout=900)
    out = [[r.metadata.src_node_id,
            r.error.reason if r.has_error() else "released"] for r in replies]
    Path(os.environ["FEDERATED_RESULT_PATH"]).write_text(json.dumps(out))
'''


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_malicious_server_app_gets_one_grant_per_round_on_real_supernodes(tmp_path):
    """Deployment on loopback: the FAB's ServerApp sends each round twice at once."""
    import shutil

    app = tmp_path / "app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "own_model" / "server_app.py").write_text(MALICIOUS_SERVER)
    home = tmp_path / "home"
    home.mkdir()
    port, health = _free_port(), _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    result = tmp_path / "result.json"
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FEDERATED_RESULT_PATH": str(result),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    procs: list[subprocess.Popen] = []
    try:
        log = (tmp_path / "superlink.log").open("w")
        procs.append(subprocess.Popen([
            str(BIN / "flower-superlink"), "--insecure",
            "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1", "--port", str(port),
            "--health-server-address", f"127.0.0.1:{health}",
        ], env=env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        time.sleep(8)
        for i in range(2):
            out = (tmp_path / f"supernode{i}.log").open("w")
            procs.append(subprocess.Popen([
                str(BIN / "flower-supernode"), "--insecure",
                "--superlink", f"127.0.0.1:{port}",
                "--host", "127.0.0.1", "--port", str(_free_port()),
                "--node-config",
                f"partition-id={i} num-partitions=3 epsilon={BUDGETS[i]} "
                f'{AGREEMENT} ledger-init=true ledger-path="{tmp_path}/l{i}.json"',
            ], env=env, stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
        run = subprocess.run(
            [sys.executable, "-m", "defense_suite.federated", "run", str(app),
             "test", "--run-config", "num-server-rounds=3 delta=0.5"],
            env=env, capture_output=True, text=True, timeout=1200, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        answers = json.loads(result.read_text())
        for node in {n for n, _ in answers}:
            got = sorted(a for n, a in answers if n == node)
            assert got == ["refused: replayed-round", "released"]
        for i in range(2):  # one grant each, at the node's own delta (not 0.5)
            ledger = json.loads((tmp_path / f"l{i}.json").read_text())
            assert len(ledger["grants"]) == 1
            assert ledger["agreement"]["delta"] == 1e-5
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
