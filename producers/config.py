"""Configuration: one settings model for the project, loaded through pydantic-settings.

`LagscopeConfig` holds one section per component. Components that come later (the stream
app, the sink) add their sections by subclassing it::

    from lagscope.producers.config import LagscopeConfig, load_config
    from lagscope.stream_app.processor import ProcessorSettings

    class AppConfig(LagscopeConfig):
        processor: ProcessorSettings = ProcessorSettings()

    config = load_config(
        AppConfig,
        env={"LAGSCOPE_PROCESSOR__LATENESS_S": "10"},        # else os.environ
        overrides={"kafka": {"bootstrap_servers": "kafka:9092"}},  # flags win
    )
    print(config.processor.lateness_s, config.kafka.bootstrap_servers)  # 10.0 kafka:9092

Sources, highest precedence first (`LagscopeConfig.settings_customise_sources`):

1. command-line flags (`overrides`; a flag left unset, None, overrides nothing);
2. environment variables `LAGSCOPE_<SECTION>__<FIELD>` (e.g.
   `LAGSCOPE_KAFKA__BOOTSTRAP_SERVERS`, `LAGSCOPE_STREAMER__LOG_DIR`); dicts such as
   `kafka.client_options` are written as JSON;
3. a secrets directory, one file per setting named like the variable without its prefix
   (`kafka__sasl_password`), as Kubernetes and Docker mount secrets: `$LAGSCOPE_SECRETS_DIR`,
   else `/run/secrets/lagscope` when it exists;
4. the config file, yaml or json (`--config`, else `$LAGSCOPE_CONFIG`);
5. the defaults below.

A misspelt setting is an error in every source, named by its source and field, never by its
value: an unknown key in the file, an unknown field under a section
(`LAGSCOPE_KAFKA__SASL_PASWORD`), and an unknown section (`LAGSCOPE_KAFAK__SASL_PASSWORD`,
which pydantic-settings alone would ignore). Variables without `__` (`LAGSCOPE_CONFIG`,
`LAGSCOPE_CLICKHOUSE_DSN`) are not settings. Kafka security settings (SSL, SASL) are passed
through to librdkafka, as is anything in `kafka.client_options`.
"""

from __future__ import annotations

import contextvars
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from lagscope.producers.config_names import (
    CONFIG_ENV,
    ENV_PREFIX,
    NESTED_DELIMITER,
    SECRETS_DIR_ENV,
)

#: Read when it exists and `$LAGSCOPE_SECRETS_DIR` does not name another directory.
DEFAULT_SECRETS_DIR = Path("/run/secrets/lagscope")


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
    #: Partitions of `topic_ops` and `topic_deadletter` when a streamer or a worker makes
    #: them (a topic that exists is left as it is); None: the broker's `num.partitions`.
    #: One job's batches go to one partition: give at least the jobs run at once, twice.
    ops_partitions: int | None = Field(default=None, ge=1)

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
    #: A job's sidecar: exit after this many seconds with nothing new once every rank log
    #: under `log_dir` holds its rank's end record (the monitor closed) and Kafka confirmed
    #: it all; a quiet job (model load, checkpoint) never counts. None = off.
    exit_after_job_end_s: float | None = Field(default=None, ge=0)
    #: On SIGTERM, keep shipping until Kafka confirmed everything the logs hold, for at
    #: most this many seconds (keep it below the pod's grace period); 0 = stop at once,
    #: what is unconfirmed stays in the logs for the next run.
    drain_s: float = Field(default=0.0, ge=0)
    #: Delete a rank's log files once everything in them is confirmed by Kafka (and the
    #: checkpoint says so). Off by default: the logs are also the local record of the run.
    delete_shipped: bool = False
    #: Serve Prometheus metrics on this port (0 = any free port, logged); None = off.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    #: Address the metrics endpoint listens on.
    metrics_addr: str = "0.0.0.0"
    #: The endpoint's /healthz fails once the shipping loop has not gone round for this
    #: long (seconds): a wedged streamer is restarted, not left holding the node's logs.
    stall_s: float = Field(default=120.0, gt=0)

    def resolved_checkpoint_path(self) -> Path:
        if self.checkpoint_path is not None:
            return self.checkpoint_path
        if self.log_dir is None:
            raise ConfigError("streamer.log_dir is not set (flag --log-dir)")
        return self.log_dir / ".streamer-checkpoint.json"


# -- where the values come from -------------------------------------------------------------
@dataclass
class _Request:
    """The inputs of one load: which file, environment and secrets directory to read.

    `load_config` sets one for the duration of a load; a plain `LagscopeConfig(...)` reads
    the process's environment (and the file and directory it names)."""

    env: Mapping[str, str]
    file: Path | None = None
    secrets_dir: Path | None = None
    #: Filled while the model is built: the sources in precedence order.
    sources: list[PydanticBaseSettingsSource] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        env: Mapping[str, str],
        file: str | os.PathLike[str] | None = None,
        secrets_dir: str | os.PathLike[str] | None = None,
    ) -> _Request:
        file = file or env.get(CONFIG_ENV) or None
        named_dir = secrets_dir or env.get(SECRETS_DIR_ENV) or None
        if named_dir is not None:
            directory: Path | None = Path(named_dir)
            if not directory.is_dir():
                raise ConfigError(f"secrets directory {directory}: no such directory")
        else:
            directory = DEFAULT_SECRETS_DIR if DEFAULT_SECRETS_DIR.is_dir() else None
        return cls(env=env, file=Path(file) if file else None, secrets_dir=directory)


_REQUEST: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
    "lagscope_config_request", default=None
)


def _has_path(data: Any, path: tuple[str | int, ...]) -> bool:
    for part in path:
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


class _VariablesSource(EnvSettingsSource):
    """`LAGSCOPE_<SECTION>__<FIELD>` variables from a given mapping (the environment, or the
    files of a secrets directory), with pydantic-settings' nesting and JSON decoding."""

    def __init__(self, settings_cls: type[BaseSettings], variables: Mapping[str, str]) -> None:
        # Names are matched case-insensitively, like the environment on every platform.
        self._variables = {name.lower(): value for name, value in variables.items()}
        self._check_sections(settings_cls)
        super().__init__(settings_cls)
        self.data: dict[str, Any] = {}

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # `null` (JSON's) unsets a value, as it did when every value was decoded as JSON.
        return {k: (None if v == "null" else v) for k, v in self._variables.items()}

    def _check_sections(self, settings_cls: type[BaseSettings]) -> None:
        """An unknown section is an error (pydantic-settings alone would skip the variable):
        a misspelt `LAGSCOPE_KAFAK__SASL_PASSWORD` must not leave the login without it."""
        prefix = ENV_PREFIX.lower()
        for name in self._variables:
            if not name.startswith(prefix) or NESTED_DELIMITER not in name:
                continue
            section = name[len(prefix) :].split(NESTED_DELIMITER)[0]
            if section not in settings_cls.model_fields:
                known = ", ".join(settings_cls.model_fields)
                raise ConfigError(
                    f"{self.describe_name(name)}: no such section {section!r} (sections: {known})"
                )

    def describe_name(self, name: str) -> str:
        return f"${name.upper()}"

    def decode_complex_value(self, field_name: str, field: Any, value: Any) -> Any:
        # Remembered so that a value that is not JSON can be named by its variable.
        self._decoding = field_name
        return super().decode_complex_value(field_name, field, value)

    def __call__(self) -> dict[str, Any]:
        self._decoding: str | None = None
        try:
            self.data = super().__call__()
        except Exception as exc:  # pydantic-settings' SettingsError: a value is not JSON
            section = str(exc).partition('field "')[2].partition('"')[0]
            names = [ENV_PREFIX + section] if section else []
            if section and self._decoding not in (None, section):
                names.insert(0, f"{names[0]}{NESTED_DELIMITER}{self._decoding}")
            where = next(
                (self.describe_name(n.lower()) for n in names if n.lower() in self._variables),
                self.describe_name(f"{ENV_PREFIX}{section or '...'}{NESTED_DELIMITER}..."),
            )
            raise ConfigError(
                f"{where}: not valid JSON (a dict or list value is written as JSON; "
                "the text is not shown)"
            ) from None
        return self.data

    def describe(self, path: tuple[str | int, ...]) -> str | None:
        """The variable that set `path` (or a part of it), if this source set it."""
        for length in range(len(path), 0, -1):
            name = ENV_PREFIX + NESTED_DELIMITER.join(map(str, path[:length]))
            if name.lower() in self._variables:
                return self.describe_name(name.lower())
        return None


class _SecretsDirSource(_VariablesSource):
    """One file per setting, named like its variable without the prefix: the way Kubernetes
    and Docker mount secrets (dot-files, such as Kubernetes' `..data`, are not settings)."""

    def __init__(self, settings_cls: type[BaseSettings], directory: Path) -> None:
        self.directory = directory
        variables: dict[str, str] = {}
        for entry in sorted(directory.iterdir()):
            if entry.name.startswith(".") or not entry.is_file():
                continue
            try:
                variables[ENV_PREFIX + entry.name] = entry.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                reason = getattr(exc, "strerror", None) or "not UTF-8 text"
                raise ConfigError(f"secret file {entry}: cannot be read ({reason})") from None
        super().__init__(settings_cls, variables)

    def describe_name(self, name: str) -> str:
        return f"secret file {self.directory / name[len(ENV_PREFIX) :]}"


class _FileSource(YamlConfigSettingsSource):
    """The config file: yaml, or json by its suffix; a parse error names the line, not the
    text (which may hold a password)."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file")
        self.path = path
        super().__init__(settings_cls, yaml_file=path)

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        return _from_file(Path(file_path))

    def describe(self, path: tuple[str | int, ...]) -> str | None:
        return str(self.path) if _has_path(self.yaml_data, path) else None


class LagscopeConfig(BaseSettings):
    """The project's configuration; components extend it with their own sections."""

    model_config = SettingsConfigDict(
        extra="forbid",
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=NESTED_DELIMITER,
        case_sensitive=False,
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    streamer: StreamerSettings = Field(default_factory=StreamerSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags > environment > secrets directory > config file (> defaults)."""
        request = _REQUEST.get() or _Request.of(os.environ)
        sources: list[PydanticBaseSettingsSource] = [
            init_settings,
            _VariablesSource(settings_cls, request.env),
        ]
        if request.secrets_dir is not None:
            sources.append(_SecretsDirSource(settings_cls, request.secrets_dir))
        if request.file is not None:
            sources.append(_FileSource(settings_cls, request.file))
        request.sources = sources
        return tuple(sources)


ConfigT = TypeVar("ConfigT", bound=LagscopeConfig)


def _from_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
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
    secrets_dir: str | os.PathLike[str] | None = None,
) -> ConfigT:
    """Flags (`overrides`) > `LAGSCOPE_<SECTION>__<FIELD>` environment > secrets directory >
    file > defaults. Any problem is one `ConfigError` line naming the source and the field."""
    env = os.environ if env is None else env
    request = _Request.of(env, file, secrets_dir)
    flags = _drop_none(dict(overrides or {}))
    token = _REQUEST.set(request)
    try:
        return model(**flags)
    except ValidationError as exc:
        problems = "; ".join(_explain(error, request.sources, flags) for error in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from None
    finally:
        _REQUEST.reset(token)


def _explain(
    error: Any, sources: list[PydanticBaseSettingsSource], flags: Mapping[str, Any]
) -> str:
    """`field (from source): problem`, without the value (it may be a password)."""
    loc = tuple(error["loc"])
    # A pydantic model says extra_forbidden, a dataclass section (the episodes' settings)
    # unexpected_keyword_argument: both mean a misspelt or unknown name.
    unknown = error["type"] in ("extra_forbidden", "unexpected_keyword_argument")
    problem = "no such setting" if unknown else error["msg"]
    return f"{'.'.join(map(str, loc))} (from {_origin(loc, sources, flags)}): {problem}"


def _origin(
    loc: tuple[str | int, ...], sources: list[PydanticBaseSettingsSource], flags: Mapping[str, Any]
) -> str:
    """The highest-precedence source that set `loc` (or the nearest enclosing setting)."""
    for length in range(len(loc), 0, -1):
        path = loc[:length]
        for source in sources:
            if isinstance(source, _VariablesSource | _FileSource):
                found = source.describe(path)
                if found is not None:
                    return found
            elif _has_path(flags, path):
                return "the command line"
    return "defaults"


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
