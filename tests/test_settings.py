"""Settings through pydantic-settings: five sources in one order, a secrets directory, and
errors that are one line naming the source and the field, never a secret's value."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lagscope.producers.config import ConfigError, LagscopeConfig, load_config
from tests.conftest import REPO_ROOT

SECRET = "s3cr3t-Pa55word"


def _sources(tmp_path: Path) -> tuple[Path, Path]:
    """A config file and a secrets directory that both set kafka.topic_ops."""
    file = tmp_path / "lagscope.yaml"
    file.write_text("kafka:\n  topic_ops: from-file\n")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "kafka__topic_ops").write_text("from-secret\n")
    return file, secrets


def test_precedence_across_the_five_sources(tmp_path: Path) -> None:
    file, secrets = _sources(tmp_path)
    env = {"LAGSCOPE_KAFKA__TOPIC_OPS": "from-env"}
    flags = {"kafka": {"topic_ops": "from-flag"}}

    def topic(**kwargs: object) -> str:
        return load_config(**kwargs).kafka.topic_ops  # type: ignore[arg-type]

    assert topic(env={}) == "lagscope.ops"  # defaults
    assert topic(env={}, file=file) == "from-file"
    assert topic(env={}, file=file, secrets_dir=secrets) == "from-secret"
    assert topic(env=env, file=file, secrets_dir=secrets) == "from-env"
    assert topic(env=env, file=file, secrets_dir=secrets, overrides=flags) == "from-flag"
    # A flag left unset (None) overrides nothing.
    unset = {"kafka": {"topic_ops": None}}
    assert topic(env=env, file=file, secrets_dir=secrets, overrides=unset) == "from-env"


def test_file_and_secrets_dir_come_from_the_environment(tmp_path: Path) -> None:
    file, secrets = _sources(tmp_path)
    env = {"LAGSCOPE_CONFIG": str(file), "LAGSCOPE_SECRETS_DIR": str(secrets)}
    assert load_config(env=env).kafka.topic_ops == "from-secret"
    (secrets / "kafka__topic_ops").unlink()
    assert load_config(env=env).kafka.topic_ops == "from-file"


def test_secrets_dir_feeds_the_sasl_password(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "kafka__sasl_password").write_text(SECRET + "\n")  # as `echo` writes it
    # Kubernetes mounts a secret's keys through `..data`: dot-entries are not settings.
    (secrets / "..data").mkdir()
    config = load_config(
        env={"LAGSCOPE_KAFKA__SASL_USERNAME": "u"},
        secrets_dir=secrets,
        overrides={"kafka": {"security_protocol": "SASL_SSL"}},
    )
    client = config.kafka.client_config()
    assert client["sasl.password"] == SECRET
    assert client["sasl.username"] == "u"
    assert SECRET not in repr(config) and SECRET not in str(config.model_dump())


def test_a_named_secrets_dir_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such directory"):
        load_config(env={"LAGSCOPE_SECRETS_DIR": str(tmp_path / "missing")})


def test_misspelt_settings_are_errors_that_never_show_the_secret(tmp_path: Path) -> None:
    # An unknown field under a known section, and an unknown section: both name the variable.
    with pytest.raises(ConfigError) as caught:
        load_config(env={"LAGSCOPE_KAFKA__SASL_PASWORD": SECRET})
    assert "kafka.sasl_pasword (from $LAGSCOPE_KAFKA__SASL_PASWORD): no such setting" in str(
        caught.value
    )
    with pytest.raises(ConfigError, match=r"\$LAGSCOPE_KAFAK__SASL_PASSWORD: no such section"):
        load_config(env={"LAGSCOPE_KAFAK__SASL_PASSWORD": SECRET})
    # Variables without a section are not settings.
    load_config(env={"LAGSCOPE_CLICKHOUSE_DSN": f"http://u:{SECRET}@h/db", "LAGSCOPE_X": "1"})
    # An unknown key in the file, and a misspelt secret file, name the file.
    file = tmp_path / "lagscope.yaml"
    file.write_text(f"kafka:\n  sasl_password: {SECRET}\nkafak:\n  sasl_password: {SECRET}\n")
    with pytest.raises(
        ConfigError, match=rf"kafak \(from {re.escape(str(file))}\): no such setting"
    ) as in_file:
        load_config(env={}, file=file)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "kafka__sasl_pasword").write_text(SECRET)
    with pytest.raises(ConfigError, match=r"secret file .*kafka__sasl_pasword") as in_dir:
        load_config(env={}, secrets_dir=secrets)
    # A bad value, wherever it comes from: the field and its source, not the value.
    (secrets / "kafka__sasl_pasword").rename(secrets / "kafka__sasl_password")
    (secrets / "streamer__linger_ms").write_text("soon")
    with pytest.raises(ConfigError, match=r"streamer\.linger_ms \(from secret file") as bad:
        load_config(env={}, secrets_dir=secrets)
    # ... the highest source that set it: here a flag, over the secret file.
    with pytest.raises(ConfigError, match=r"sasl_password \(from the command line\)") as flag:
        load_config(env={}, secrets_dir=secrets, overrides={"kafka": {"sasl_password": 5}})
    with pytest.raises(
        ConfigError, match=r"\$LAGSCOPE_KAFKA__CLIENT_OPTIONS.*not valid JSON"
    ) as js:
        load_config(env={"LAGSCOPE_KAFKA__CLIENT_OPTIONS": f'{{"sasl.password": "{SECRET}"'})
    for error in (caught, in_file, in_dir, bad, flag, js):
        message = str(error.value)
        assert SECRET not in message and "\n" not in message, message


def test_a_plain_model_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """LagscopeConfig is a BaseSettings: constructed directly, it reads the same sources."""
    monkeypatch.setenv("LAGSCOPE_STREAMER__LINGER_MS", "11")
    config = LagscopeConfig(kafka={"topic_ops": "direct"})  # type: ignore[arg-type]
    assert (config.streamer.linger_ms, config.kafka.topic_ops) == (11, "direct")


def test_stream_reads_the_password_from_a_secrets_dir_and_never_prints_it(
    tmp_path: Path,
) -> None:
    """End to end: a bad secret file next to the password is one error line without it."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "kafka__sasl_password").write_text(SECRET)
    (secrets / "kafka__security_protocol").write_text("SASL_NOPE")
    (tmp_path / "logs").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "lagscope.cli", "stream", "--log-dir",
         str(tmp_path / "logs"), "--bootstrap-servers", "127.0.0.1:9"],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False,
        env={**os.environ, "LAGSCOPE_SECRETS_DIR": str(secrets)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "kafka.security_protocol (from secret file" in lines[0]
    assert SECRET not in done.stdout + done.stderr
