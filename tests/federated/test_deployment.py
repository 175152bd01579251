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
import subprocess
import time
from pathlib import Path

import pytest

from tests.federated.superlink import (
    BIN,
    BUDGETS,
    EXAMPLE,
    REPO,
    Processes,
    assert_unsigned_fab_refused,
    example_run,
    flower_env,
    free_port,
    insecure_deployment,
    node_config,
    superlink_command,
    superlink_home,
    supernode_args,
    trusted_entities,
)


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


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a fresh ClientApp process per message, 12 in all
def test_tls_deployment_with_authenticated_supernodes(tmp_path):
    tls = make_tls(tmp_path)
    port, health = free_port(), free_port()
    result = tmp_path / "result.json"
    env = flower_env(
        superlink_home(tmp_path, port, tls["ca"]), FEDERATED_RESULT_PATH=str(result)
    )
    procs = Processes(tmp_path, env)
    try:
        procs.start("superlink", superlink_command(
            port, health, "--ssl-ca-certfile", str(tls["ca"]),
            "--ssl-certfile", str(tls["cert"]), "--ssl-keyfile", str(tls["key"]),
            "--enable-supernode-auth",
        ))  # fmt: skip
        time.sleep(8)
        keys = [make_node_key(tmp_path, f"node{i}") for i in range(4)]
        for _, public in keys[:3]:
            done = subprocess.run(
                [str(BIN / "flwr"), "supernode", "register", str(public), "test"],
                env=env, capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
        for i, (private, _) in enumerate(keys):
            procs.start(f"supernode{i}", [
                str(BIN / "flower-supernode"),
                "--superlink", f"127.0.0.1:{port}",
                "--root-certificates", str(tls["ca"]),
                "--auth-supernode-private-key", str(private),
                "--host", "127.0.0.1", "--port", str(free_port()),
                "--max-retries", "3",
                "--node-config", node_config(i, tmp_path / f"ledger-{i}.json"),
            ])  # fmt: skip
        run = example_run(env, timeout=2200)
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
        again = example_run(env, timeout=1200)
        assert again.returncode == 1
        assert "refused: over-budget" in again.stdout
        text = procs.logs["supernode3"].read_text(errors="replace")
        assert "Failed to activate SuperNode" in text  # Flower's exit code 305
    finally:
        procs.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_supernodes_with_trusted_entities_refuse_a_local_fab(tmp_path):
    """Flower's FAB verification needs the app hub: a local app is refused.

    Two SuperNodes started with ``--trusted-entities`` (an Ed25519 key) refuse the
    FAB of a local ``flwr run`` before any ClientApp code runs (Flower 1.42 wants a
    ``valid_license`` verification that only a hub-backed SuperLink adds). This is
    why docs/federated.md assumes the node runs ClientApp code it trusts.
    """
    trusted = trusted_entities(tmp_path)

    def supernode(i, port):
        return [str(BIN / "flower-supernode"), *supernode_args(i, port, tmp_path),
                "--trusted-entities", str(trusted)]  # fmt: skip

    assert_unsigned_fab_refused(tmp_path, supernode)


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
    result = tmp_path / "result.json"

    def supernode(i, port):
        return [str(BIN / "flower-supernode"), *supernode_args(i, port, tmp_path)]

    pythonpath = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    with insecure_deployment(
        tmp_path, supernode, FEDERATED_RESULT_PATH=str(result), PYTHONPATH=pythonpath
    ) as (env, _, _):
        run = example_run(env, app, "num-server-rounds=3 delta=0.5", 1200)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        answers = json.loads(result.read_text())
        for node in {n for n, _ in answers}:
            got = sorted(a for n, a in answers if n == node)
            assert got == ["refused: replayed-round", "released"]
        for i in range(2):  # one grant each, at the node's own delta (not 0.5)
            ledger = json.loads((tmp_path / f"l{i}.json").read_text())
            assert len(ledger["grants"]) == 1
            assert ledger["agreement"]["delta"] == 1e-5
