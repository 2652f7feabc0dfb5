"""HTTPS on the three servers: an orchestrator, an origin and a relay given ``--tls-cert`` and
``--tls-key`` (a CA made here), their clients on ``https://`` URLs trusting that CA through
``SSL_CERT_FILE``. Weights cross two TLS hops byte-exact (shards are not sent with
``sendfile`` under TLS); a client that does not trust the CA, or reaches a server whose
certificate names another host, gets a one-line error at once."""

import os
import subprocess
import sys
import time

import pytest

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import PeerUnavailable
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.serving import Tls
from swarmrl.shardcast import Publisher, WeightClient
from swarmrl.shardcast.catalog import Catalog
from swarmrl.shardcast.server import build_app, serve_in_thread
from swarmrl.testing.shardcast import random_weights, write_checkpoint
from swarmrl.testing.tls import TestCA

SWARMRL = [sys.executable, "-m", "swarmrl.cli"]
KEY = KeyPair.from_seed(b"\x39" * 32)
CFG = ShardcastConfig(shard_size_bytes=256 * 1024, request_timeout_s=10)


@pytest.fixture
def ca(tmp_path):
    return TestCA(tmp_path / "ca")


def _start(argv, port_file, env, timeout_s=60):
    proc = subprocess.Popen(
        SWARMRL + argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + timeout_s
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{argv[0]} did not start: {proc.stdout.read()}")
        time.sleep(0.1)
    return proc, int(port_file.read_text())


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def test_the_orchestrator_serves_https_to_clients_that_trust_its_ca(tmp_path, ca, monkeypatch):
    cert, key = ca.issue("orch", ["127.0.0.1"])
    KeyPair.generate().save(tmp_path / "orch.key")
    argv = ["orchestrator", "--key", str(tmp_path / "orch.key"), "--port", "0"]
    argv += ["--port-file", str(tmp_path / "port"), "--run-dir", str(tmp_path / "run")]
    argv += ["--tls-cert", str(cert), "--tls-key", str(key)]
    proc, port = _start(argv, tmp_path / "port", os.environ.copy())
    try:
        url = f"https://127.0.0.1:{port}"
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        with pytest.raises(PeerUnavailable, match="CERTIFICATE_VERIFY_FAILED") as untrusted:
            PoolClient(url, KeyPair.generate(), timeout_s=10).health()
        assert "\n" not in str(untrusted.value)
        monkeypatch.setenv("SSL_CERT_FILE", str(ca.bundle))
        node = KeyPair.generate()
        assert PoolClient(url, node).health()["ok"] is True
        assert PoolClient(url, node).pools() == []  # a signed route too
        plain = PoolClient(f"http://127.0.0.1:{port}", node, timeout_s=10)
        with pytest.raises(PeerUnavailable):  # plain HTTP on the TLS port: refused, not hung
            plain.health()
    finally:
        _stop(proc)


def test_weights_cross_an_https_origin_and_relay_byte_exact(tmp_path, ca, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.bundle))
    weights = random_weights(600_000, seed=4)  # 2.4 MB: ten shards
    Publisher(tmp_path / "store", KEY, CFG).publish(write_checkpoint(tmp_path / "ck", weights), 1)
    origin_cert, origin_key = ca.issue("origin", ["127.0.0.1"])
    catalog = Catalog(tmp_path / "store", CFG.keep_versions)
    catalog.refresh()
    origin = serve_in_thread(
        build_app(catalog, CFG, role="origin"), tls=Tls(str(origin_cert), str(origin_key))
    )
    relay_cert, relay_key = ca.issue("relay", ["127.0.0.1"])
    argv = ["relay", "--upstream", origin.url, "--publisher-key", KEY.public_key_hex]
    argv += ["--store", str(tmp_path / "relay"), "--port", "0"]
    argv += ["--tls-cert", str(relay_cert), "--tls-key", str(relay_key)]
    argv += ["--set", "shardcast.shard_size_bytes=262144"]
    relay = subprocess.Popen(
        SWARMRL + argv, env=os.environ.copy(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert origin.url.startswith("https://")
        line = relay.stdout.readline()
        assert line.startswith("serving on https://"), line
        relay_url = line.split()[-1]
        client = WeightClient([relay_url], KEY.public_key_hex, tmp_path / "out", CFG)
        deadline = time.monotonic() + 60
        while True:
            try:
                path = client.fetch(1)
                break
            except PeerUnavailable:  # the relay has not got v1 yet
                assert time.monotonic() < deadline, "the relay never served v1"
                time.sleep(0.3)
        from safetensors.numpy import load_file

        got = load_file(os.path.join(path, "model.safetensors"))
        assert sorted(got) == sorted(weights)
        for name, tensor in weights.items():
            assert (got[name] == tensor).all(), name
    finally:
        _stop(relay)
        origin.stop()


def test_a_certificate_for_another_host_is_a_one_line_error(tmp_path, ca, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.bundle))
    cert, key = ca.issue("elsewhere", ["orch.example.org"])
    catalog = Catalog(tmp_path / "store", CFG.keep_versions)
    server = serve_in_thread(build_app(catalog, CFG, role="origin"), tls=Tls(str(cert), str(key)))
    try:
        started = time.monotonic()
        with pytest.raises(PeerUnavailable, match="mismatch|doesn't match|not valid") as wrong:
            PoolClient(server.url, KeyPair.generate(), timeout_s=10).health()
        assert "\n" not in str(wrong.value)
        assert time.monotonic() - started < 10  # refused, not waited out
    finally:
        server.stop()


@pytest.mark.parametrize("verb", ["orchestrator", "relay", "trainer"])
def test_a_certificate_without_its_key_is_refused_in_one_line(tmp_path, verb):
    (tmp_path / "c.pem").write_text("x")
    argv = {
        "orchestrator": ["orchestrator", "--key", "k"],
        "relay": ["relay", "--upstream", "http://x", "--publisher-key", KEY.public_key_hex],
        "trainer": ["trainer", "--key", "k", "--orchestrator", "http://x", "--run-dir", "r"],
    }[verb]
    if verb == "relay":
        argv += ["--store", str(tmp_path / "s")]
    done = subprocess.run(
        SWARMRL + argv + ["--tls-cert", str(tmp_path / "c.pem")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith(
        "--tls-cert and --tls-key go together: give both or neither"
    )
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
