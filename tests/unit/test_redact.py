"""Secrets (…KEY, …TOKEN, …SECRET, …PASSWORD) never reach configs, logs or W&B in clear."""

from __future__ import annotations

import logging

from hpctrain.metrics.redact import MASK, SecretFilter, redact, redact_yaml_files


def test_redact_by_key_and_in_override_strings():
    cfg = {"cluster": {"env": {"WANDB_API_KEY": "k" * 40, "NCCL_IB_HCA": "mlx5",
                               "db_password": "pw", "Hf_Token": "t0k3n", "EMPTY_KEY": ""}},
           "overrides": ["+cluster.env.MY_SECRET=abc", "train.steps=5", "x=y=z"]}
    out = redact(cfg)
    env = out["cluster"]["env"]
    assert env == {"WANDB_API_KEY": MASK, "NCCL_IB_HCA": "mlx5", "db_password": MASK,
                   "Hf_Token": MASK, "EMPTY_KEY": ""}
    assert out["overrides"] == ["+cluster.env.MY_SECRET=***", "train.steps=5", "x=y=z"]
    assert cfg["cluster"]["env"]["WANDB_API_KEY"] == "k" * 40  # the input is not modified


def test_log_filter_scrubs_values_anywhere(caplog, monkeypatch):
    monkeypatch.setenv("SOME_SERVICE_TOKEN", "tok-123456")
    from hpctrain.metrics.redact import secret_values

    values = secret_values({"MY_KEY": "abcdef", "SHORT_KEY": "1", "PLAIN": "visible"})
    assert {"tok-123456", "abcdef"} <= values and "1" not in values and "visible" not in values
    logger = logging.getLogger("test.redact")
    flt = SecretFilter(values)
    caplog.handler.addFilter(flt)
    try:
        with caplog.at_level(logging.INFO):
            logger.info("connecting with %s and key=%s, %s", "tok-123456", "abcdef", "visible")
    finally:
        caplog.handler.removeFilter(flt)
    assert "tok-123456" not in caplog.text and "abcdef" not in caplog.text
    assert f"connecting with {MASK} and key={MASK}, visible" in caplog.text


def test_yaml_files_rewritten(tmp_path):
    (tmp_path / "config.yaml").write_text("cluster:\n  env:\n    HF_TOKEN: abc\n    A: b\n")
    (tmp_path / "overrides.yaml").write_text("- +cluster.env.HF_TOKEN=abc\n- model=debug\n")
    redact_yaml_files([tmp_path / "config.yaml", tmp_path / "overrides.yaml",
                       tmp_path / "missing.yaml"])
    assert "abc" not in (tmp_path / "config.yaml").read_text()
    assert "A: b" in (tmp_path / "config.yaml").read_text()
    assert (tmp_path / "overrides.yaml").read_text().splitlines() == [
        "- +cluster.env.HF_TOKEN=***", "- model=debug"]


def test_concurrent_tasks_writing_and_redacting_one_file(tmp_path):
    """A Slurm job's tasks each write Hydra's config (not atomically) and then redact it: no
    task fails on a half-written file and the file ends redacted."""
    import threading
    import time

    path = tmp_path / "config.yaml"
    text = "cluster:\n  env:\n    HF_TOKEN: abc123\n" + "".join(
        f"k{i}: {i}\n" for i in range(200))
    errors = []

    def task() -> None:
        try:
            with path.open("w") as f:  # as Hydra writes: truncate, then the text in pieces
                f.write(text[:50])
                f.flush()
                time.sleep(0.02)
                f.write(text[50:])
            redact_yaml_files([path])
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=task) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert "abc123" not in path.read_text() and "HF_TOKEN: '***'" in path.read_text()
