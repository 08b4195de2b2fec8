"""Secrets never reach configs, logs, summaries or W&B in clear: credential names by their
parts, user-listed names, masking by value anywhere, and paths never masked."""

from __future__ import annotations

import logging

import pytest

from hpctrain.metrics.redact import MASK, SecretFilter, Secrets, is_secret


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "HF_TOKEN", "DB_PASSWD", "HF_AUTH",
                                  "MYSQL_PWD", "DB_PASS",
                                  "OAUTH_CLIENT", "GhToken", "AWS_SECRET_ACCESS_KEY",
                                  "GOOGLE_CREDENTIALS", "PRIVATE_KEY", "db_password", "APIKEY",
                                  "GITHUB_PAT", "gitlab-pat"])
def test_credential_names(name):
    assert is_secret(name)


@pytest.mark.parametrize("name", ["PWD", "OLDPWD", "SSH_AUTH_SOCK", "XAUTHORITY", "AUTHOR",
                                  "TOKENIZER_PATH", "KEYBOARD_LAYOUT", "NCCL_IB_HCA", "HOME",
                                  "HPCTRAIN_COMPAT", "PATH"])
def test_names_that_are_not_credentials(name):
    assert not is_secret(name)


def test_listed_names_and_values_of_the_environment_and_cluster_env(tmp_path):
    (tmp_path / "creds.json").write_text("{}")  # a credential file's path is not a secret
    environ = {"DB_PASSWD": "pa55-w0rd", "HF_AUTH": "hf_auth_value", "TEAM": "team-name-x",
               "AWS_SECRET_ACCESS_KEY": "/wJalrXUtnFEMI/K7MDENG",  # looks like a path: masked
               "MYSQL_PWD": "mysql-pw-1",
               "SSH_AUTH_SOCK": str(tmp_path / "agent.sock"), "PWD": str(tmp_path),
               "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "creds.json"),
               "SHORT_KEY": "12345", "PLAIN": "visible-value"}
    secrets = Secrets.of({"SERVICE_TOKEN": "svc-token-1", "NCCL_DEBUG": "INFO"}, ["team"],
                         environ=environ)
    assert set(secrets.values) == {"pa55-w0rd", "hf_auth_value", "team-name-x", "svc-token-1",
                                   "/wJalrXUtnFEMI/K7MDENG", "mysql-pw-1"}
    text = f"cd {tmp_path} && login pa55-w0rd svc-token-1 as team-name-x, visible-value"
    assert secrets.text(text) == f"cd {tmp_path} && login *** *** as ***, visible-value"


def test_documents_masked_by_value_and_env_entries_by_name():
    secrets = Secrets.of({"MY_SECRET": "abc"}, environ={"HF_TOKEN": "hf-token-123"})
    doc = {"cluster": {"env": {"MY_SECRET": "abc", "NCCL_IB_HCA": "mlx5", "EMPTY_KEY": ""}},
           "logger": {"run_name": "run-hf-token-123"}, "data": {"tokenizer_path": "/t",
                                                               "eod_token": "</s>"},
           "overrides": ["+cluster.env.MY_SECRET=abc", "train.steps=5", "x=y=z",
                         "logger.run_name=hf-token-123"],
           "job": {"override_dirname": "+cluster.env.MY_SECRET=abc,train.steps=5",
                   "env_set": {"OTHER_TOKEN": "xy"}}}
    out = secrets.data(doc)
    assert out["cluster"]["env"] == {"MY_SECRET": MASK, "NCCL_IB_HCA": "mlx5", "EMPTY_KEY": ""}
    assert out["logger"]["run_name"] == "run-***"
    assert out["data"] == {"tokenizer_path": "/t", "eod_token": "</s>"}  # not env: by value
    assert out["overrides"] == ["+cluster.env.MY_SECRET=***", "train.steps=5", "x=y=z",
                                "logger.run_name=***"]
    assert out["job"] == {"override_dirname": "+cluster.env.MY_SECRET=***,train.steps=5",
                          "env_set": {"OTHER_TOKEN": MASK}}
    assert doc["cluster"]["env"]["MY_SECRET"] == "abc"  # the input is not modified


def test_log_filter_scrubs_values_anywhere(caplog):
    secrets = Secrets.of({"MY_KEY": "abcdef"}, environ={"SOME_SERVICE_TOKEN": "tok-123456"})
    logger = logging.getLogger("test.redact")
    flt = SecretFilter(secrets)
    caplog.handler.addFilter(flt)
    try:
        with caplog.at_level(logging.INFO):
            logger.info("connecting with %s and key=%s, %s", "tok-123456", "abcdef", "visible")
    finally:
        caplog.handler.removeFilter(flt)
    assert "tok-123456" not in caplog.text and "abcdef" not in caplog.text
    assert f"connecting with {MASK} and key={MASK}, visible" in caplog.text


def test_url_passwords_are_masked_whatever_their_name_and_length():
    """DATABASE_URL=postgres://u:pw@h/db was written in clear (issue 45): the password of any
    URL is masked, in documents and in log records, even with no secret known by name."""
    secrets = Secrets.of(environ={})
    doc = {"db": "postgres://u:pw@h/db", "list": ["redis://:s3@cache:6379/0"],
           "plain": "https://example.org/a:b@c", "path": "/data/x:y@z"}
    assert secrets.data(doc) == {"db": f"postgres://u:{MASK}@h/db",
                                 "list": [f"redis://:{MASK}@cache:6379/0"],
                                 "plain": "https://example.org/a:b@c", "path": "/data/x:y@z"}
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "url %s", ("mysql://a:b@h",),
                               None)
    assert SecretFilter(secrets).filter(record)
    assert record.getMessage() == f"url mysql://a:{MASK}@h"
