"""W&B never kills a run: an unreachable server or a rejected key degrades to offline."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hpctrain.config.schema import LoggerConfig
from hpctrain.metrics.redact import Secrets
from hpctrain.metrics.wandb_logger import WandbLogger, server_reachable


class _Reject(BaseHTTPRequestHandler):
    """A W&B server that refuses every key."""

    def _reply(self):
        self.send_response(401)
        self.end_headers()
        self.wfile.write(b'{"errors": ["invalid api key"]}')

    do_GET = do_POST = _reply

    def log_message(self, *args):
        pass


@pytest.fixture
def rejecting_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Reject)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture
def fresh_wandb_service():
    """wandb-core is one service per process and keeps the WANDB_BASE_URL it started with: a
    service left by an earlier test (the unreachable case's offline run) would send this
    test's init to that old server, where it retries until INIT_TIMEOUT_S (30 s) instead of
    meeting the server under test."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


@pytest.mark.parametrize("where", ["unreachable", "rejects_key"])
def test_online_failure_degrades_to_offline(where, rejecting_server, tmp_path, monkeypatch,
                                            caplog, fresh_wandb_service):
    url = "http://127.0.0.1:9" if where == "unreachable" else rejecting_server
    monkeypatch.setenv("WANDB_API_KEY", "f" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.setenv("WANDB_SILENT", "true")
    with caplog.at_level(logging.WARNING):
        env = {"HF_TOKEN": "hf-secret-value"}
        logger = WandbLogger(LoggerConfig(wandb="auto"), run_dir=tmp_path,
                             config={"cluster": {"env": env}}, secrets=Secrets.of(env))
    assert logger.mode == "offline" and logger.run is not None
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert ("unreachable" if where == "unreachable" else "online init failed") in caplog.text
    if where == "rejects_key":  # refused by the server under test, not a timeout elsewhere
        assert "invalid api key" in caplog.text, caplog.text
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    assert not [p for p in files if b"hf-secret-value" in p.read_bytes()]


def test_probe_is_bounded_and_true_for_a_listening_server(rejecting_server):
    assert server_reachable(rejecting_server, timeout_s=2.0)
    assert not server_reachable("http://127.0.0.1:9", timeout_s=2.0)
    assert not server_reachable("not a url", timeout_s=1.0)
