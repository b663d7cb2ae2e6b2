"""Configuration: one pydantic model for the project, loaded from file, environment and flags.

`LagscopeConfig` holds one section per component. Components that come later (the stream
app, the sink) add their sections by subclassing it::

    class AppConfig(LagscopeConfig):
        processor: ProcessorSettings = ProcessorSettings()

    config = load_config(AppConfig, file=path, overrides={...})

Precedence, lowest first: defaults, the config file (yaml or json; `LAGSCOPE_CONFIG` names
it when no path is passed), environment variables `LAGSCOPE_<SECTION>__<FIELD>` (e.g.
`LAGSCOPE_KAFKA__BOOTSTRAP_SERVERS`, `LAGSCOPE_STREAMER__LOG_DIR`), then explicit overrides
(command-line flags). Kafka security settings (SSL, SASL) are passed through to
librdkafka, as is anything in `kafka.client_options`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

ENV_PREFIX = "LAGSCOPE_"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the source and the field."""


class KafkaSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bootstrap_servers: str = "127.0.0.1:9092"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None
    ssl_key_password: SecretStr | None = None
    #: Any other librdkafka property, passed through verbatim (e.g. "socket.keepalive.enable").
    client_options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    topic_ops: str = "lagscope.ops"
    topic_deadletter: str = "lagscope.deadletter"
    topic_jobs: str = "lagscope.jobs"

    def client_config(self) -> dict[str, Any]:
        """librdkafka properties for connection and security (shared by all clients)."""
        config: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol,
        }
        optional = {
            "sasl.mechanism": self.sasl_mechanism,
            "sasl.username": self.sasl_username,
            "sasl.password": self.sasl_password.get_secret_value() if self.sasl_password else None,
            "ssl.ca.location": self.ssl_ca_location,
            "ssl.certificate.location": self.ssl_certificate_location,
            "ssl.key.location": self.ssl_key_location,
            "ssl.key.password": (
                self.ssl_key_password.get_secret_value() if self.ssl_key_password else None
            ),
        }
        config.update({k: v for k, v in optional.items() if v is not None})
        config.update(self.client_options)
        return config


class StreamerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Directory holding one `rank-NNNNNN/` log directory per rank.
    log_dir: Path | None = None
    #: Where delivered positions are kept; default `<log_dir>/.streamer-checkpoint.json`.
    checkpoint_path: Path | None = None
    compression: Literal["zstd", "lz4", "gzip", "snappy", "none"] = "zstd"
    linger_ms: int = Field(default=20, ge=0)
    #: Give up on a message after this long and re-send it from the log (0 = never).
    delivery_timeout_ms: int = Field(default=120_000, ge=0)
    #: Stop reading the log while this many bytes are unconfirmed (the log is the buffer).
    max_in_flight_bytes: int = Field(default=64 << 20, gt=0)
    checkpoint_interval_s: float = Field(default=0.5, gt=0)
    poll_interval_s: float = Field(default=0.1, gt=0)
    #: A partial record at the end of a rank's newest file is declared torn after this long.
    torn_grace_s: float = Field(default=30.0, ge=0)
    #: Exit after this many seconds with nothing new and nothing unconfirmed (backfills,
    #: tests); None = run until stopped.
    idle_exit_s: float | None = Field(default=None, ge=0)
    #: Delete a rank's log files once everything in them is confirmed by Kafka (and the
    #: checkpoint says so). Off by default: the logs are also the local record of the run.
    delete_shipped: bool = False
    #: Serve Prometheus metrics on this port (0 = any free port, logged); None = off.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    #: Address the metrics endpoint listens on.
    metrics_addr: str = "0.0.0.0"

    def resolved_checkpoint_path(self) -> Path:
        if self.checkpoint_path is not None:
            return self.checkpoint_path
        if self.log_dir is None:
            raise ConfigError("streamer.log_dir is not set (flag --log-dir)")
        return self.log_dir / ".streamer-checkpoint.json"


class LagscopeConfig(BaseModel):
    """The project's configuration; components extend it with their own sections."""

    model_config = ConfigDict(extra="forbid")

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    streamer: StreamerSettings = Field(default_factory=StreamerSettings)


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        # JSON for structured values (client_options, numbers, booleans), else the string.
        try:
            node[path[-1]] = json.loads(value)
        except ValueError:
            node[path[-1]] = value
    return out


def _from_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        # Only the position and the problem: the parser's own message quotes the file's
        # text, which may hold a password.
        raise ConfigError(
            f"{path}: not valid {path.suffix.lstrip('.') or 'yaml'}: {_where_broken(exc)}"
        ) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    return raw


def _where_broken(exc: Exception) -> str:
    """Where a yaml or json parse failed, and the parser's short reason, without the text."""
    if isinstance(exc, json.JSONDecodeError):
        return f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or "syntax error"
    if mark is None:
        return str(problem)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def load_config(
    model: type[ConfigT] = LagscopeConfig,  # type: ignore[assignment]
    *,
    file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ConfigT:
    """Defaults < file < `LAGSCOPE_<SECTION>__<FIELD>` environment < overrides."""
    env = os.environ if env is None else env
    sources: list[tuple[str, dict[str, Any]]] = []
    file = file or env.get(f"{ENV_PREFIX}CONFIG")
    if file:
        sources.append((str(file), _from_file(Path(file))))
    sources.append(("environment", _from_env(env)))
    sources.append(("flags", _drop_none(dict(overrides or {}))))
    merged: dict[str, Any] = {}
    for _, data in sources:
        merged = _deep_merge(merged, data)
    try:
        return model.model_validate(merged)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        origin = ", ".join(name for name, data in sources if data)
        raise ConfigError(
            f"invalid configuration (from {origin or 'defaults'}): {problems}"
        ) from None


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    """Flags left unset (None) must not override the file or environment."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            value = _drop_none(value)
            if value:
                out[key] = value
        elif value is not None:
            out[key] = value
    return out
