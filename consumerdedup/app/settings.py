"""Settings: what a service reads from ``CONSUMERDEDUP_*`` variables and an env file.

Through pydantic-settings (the ``app`` extra): every field reads
``CONSUMERDEDUP_<FIELD>`` (``CONSUMERDEDUP_DATABASE_URL``, ``CONSUMERDEDUP_WORKERS``...),
then the env file, then its default. What code (or a command-line flag) gives
explicitly beats the environment: ``Settings.load(env_file, **overrides)``.
The URLs are secrets: repr, str and every error show ``**********``, never them.
A value that does not parse is a ConfigurationError naming the variable (or the
keyword, when code gave it), what was given (never a secret) and what is expected.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from .. import options
from ..errors import ConfigurationError

PREFIX = "CONSUMERDEDUP_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")

_EXPECTED = {
    "database_url": "a SQLAlchemy database URL",
    "kafka_bootstrap_servers": "host:port[,host:port...]",
    "rabbitmq_url": "an AMQP URL",
    "log_level": "one of " + ", ".join(LOG_LEVELS),
    "log_format": "'text' or 'json'",
    "health_port": "a port number from 1 to 65535",
    "workers": "an integer from 1 to 1024",
    "shutdown_timeout": "a number of seconds > 0",
    "log_config": "the path of a logging dictConfig file",
    "liveness_timeout": "a number of seconds >= 1",
    "admin_port": "a port number from 1 to 65535",
    "admin_host": "an address to bind, e.g. 127.0.0.1",
    "admin_token": "a token of at least 16 characters",
}
_SECRET = frozenset({"database_url", "rabbitmq_url", "admin_token"})
MAX_WORKERS = 1024
LIVENESS_FLOOR = 1.0
"""The shortest liveness timeout: a child reports its parts twice a second, so a shorter
one failed /livez while every loop turned (0.2 was taken: the orchestrator restarted
healthy pods)."""
"""The most worker processes ``consumerdedup run`` starts (Settings.workers' bound)."""


class Settings(BaseSettings):
    """A service's settings; frozen. ``Settings.load()`` is the way in (see the module)."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX,
        extra="ignore",  # other variables share the env file; misspelt ones of ours: load()
        populate_by_name=True,
        frozen=True,
        validate_default=True,
        hide_input_in_errors=True,
    )

    database_url: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices(PREFIX + "DATABASE_URL", PREFIX + "DB_URL"),
    )
    """``CONSUMERDEDUP_DATABASE_URL`` (or the CLI's ``CONSUMERDEDUP_DB_URL``): the database
    of the dedup tables and the handlers' writes (a secret: its password)."""
    kafka_bootstrap_servers: str | None = None
    rabbitmq_url: SecretStr | None = None
    """A secret: its password."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    health_port: int | None = Field(default=None, ge=1, le=65535)
    """Where ``consumerdedup run`` serves /livez, /readyz and /metrics; None: nowhere."""
    workers: int = Field(default=1, ge=1, le=1024)
    """Worker processes, at most MAX_WORKERS (10**20 was taken, and the supervisor hung
    making a slot for each before it started one)."""
    shutdown_timeout: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    """Seconds a graceful stop may take (the batches in flight commit and ack)."""
    log_config: str | None = None
    """A logging dictConfig file (JSON or YAML) for ``consumerdedup run``."""
    liveness_timeout: float = Field(default=60.0, ge=LIVENESS_FLOOR, allow_inf_nan=False)
    """/livez fails when a part's loop has not turned for this many seconds."""
    admin_port: int | None = Field(default=None, ge=1, le=65535)
    """Where ``consumerdedup run``'s supervisor serves the admin pages (docs/admin.md);
    None: the port of ``app.admin(port=...)``, else nowhere."""
    admin_host: str = Field(default="127.0.0.1", min_length=1)
    """The admin pages' bind address; one off loopback needs ``admin_token``."""
    admin_token: SecretStr | None = Field(default=None, min_length=16)
    """The admin pages' access token (a secret), as ``consumerdedup admin`` reads it."""

    secret_fields: ClassVar[frozenset[str]] = _SECRET

    @field_validator("database_url")
    @classmethod
    def _a_database_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and (problem := database_url_problem(value.get_secret_value())):
            raise ValueError(problem)
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_capitals(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @classmethod
    def load(cls, env_file: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
        """The environment and ``env_file`` under ``overrides`` (None: not given, the
        environment decides). ConfigurationError for a value that does not parse, a
        keyword that is not a setting, an env file that does not exist."""
        given = {name: value for name, value in overrides.items() if value is not None}
        for name in given:
            if name not in cls.model_fields:
                known = ", ".join(cls.model_fields)
                raise ConfigurationError(f"Settings: no setting {name!r} (settings: {known})")
        _check_code_values(given)
        if env_file is not None:
            _check_env_file(env_file)
        try:
            return cls(_env_file=env_file, **given)  # type: ignore[call-arg]
        except ValidationError as error:
            raise _said(error, given, env_file) from None

    def secret(self, name: str) -> str | None:
        """The value of a secret field (``database_url``, ``rabbitmq_url``) to connect with."""
        value = getattr(self, name)
        return None if value is None else str(value.get_secret_value())


def database_url_problem(url: str) -> str | None:
    """Why ``url`` is not a database URL SQLAlchemy can connect with, or None; it never
    quotes the URL (its password). Checked where the URL is given: one that did not parse
    stopped the worker later with a bare ArgumentError and exit 1, and a password with a
    bare '@' was cut there, the rest taken for the host and printed in every "cannot
    resolve the host" line, by --check, in the logs and on /readyz."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        return "it does not parse as dialect[+driver]://user:password@host:port/database"
    if parsed.host is not None and "@" in parsed.host:
        return "an '@' in the password must be percent-encoded (%40)"
    try:
        parsed.get_dialect()
    except NoSuchModuleError:
        return f"SQLAlchemy knows no database {parsed.drivername!r}"
    return None


def _check_code_values(given: dict[str, Any]) -> None:
    """What code gives is checked as every constructor checks its options: no coercion
    (``workers="4"`` is refused; only the environment's text is parsed)."""
    checks: dict[str, Callable[[Any, str], object]] = {
        "workers": lambda v, o: options.integer(v, o, at_least=1, at_most=MAX_WORKERS),
        "health_port": lambda v, o: options.integer(v, o, at_least=1, at_most=65535),
        "shutdown_timeout": lambda v, o: options.number(v, o, above=0),
        "liveness_timeout": lambda v, o: options.number(v, o, at_least=LIVENESS_FLOOR),
        "log_config": options.text,
        "log_format": lambda v, o: options.choice(v, o, LOG_FORMATS),
        "log_level": lambda v, o: options.choice(
            v.upper() if isinstance(v, str) else v, o, LOG_LEVELS
        ),
        "kafka_bootstrap_servers": options.text,
        "admin_port": lambda v, o: options.integer(v, o, at_least=1, at_most=65535),
        "admin_host": options.text,
    }
    for name, value in given.items():
        if name in checks:
            checks[name](value, f"Settings.load({name}=...)")
        elif name in _SECRET and not isinstance(value, str | SecretStr):
            raise options.refuse(f"Settings.load({name}=...)", value, "a URL string", secret=True)


def _check_env_file(env_file: str | os.PathLike[str]) -> None:
    """The file exists, and every ``CONSUMERDEDUP_`` key in it is a setting (a misspelt
    one would be ignored, and its default used without a word)."""
    from dotenv import dotenv_values

    path = os.fspath(env_file)
    if not os.path.isfile(path):
        raise ConfigurationError(f"env file {path!r} does not exist: give an existing file")
    try:
        with open(path, "rb") as file:
            file.read().decode("utf-8")  # as python-dotenv reads it: a bare UnicodeDecodeError
    except UnicodeDecodeError as error:
        raise ConfigurationError(
            f"env file {path!r} is not UTF-8 text (a byte 0x{error.object[error.start]:02x} "
            f"at offset {error.start}): save it as UTF-8"
        ) from None
    except OSError as error:
        raise ConfigurationError(f"env file {path!r} cannot be read: {error.strerror}") from None
    known = {PREFIX + name.upper() for name in _EXPECTED} | {PREFIX + "DB_URL"}
    for key in dotenv_values(path):
        if key.upper().startswith(PREFIX) and key.upper() not in known:
            raise ConfigurationError(
                f"{key} in {path!r} is not a setting (settings: {', '.join(sorted(known))})"
            )


def _said(error: ValidationError, given: dict[str, Any], env_file: object) -> ConfigurationError:
    """The first problem, naming the variable (or keyword) as the user wrote it."""
    problem = error.errors()[0]
    field = str(problem["loc"][0]).lower().removeprefix(PREFIX.lower()) if problem["loc"] else ""
    field = "database_url" if field == "db_url" else field
    if field not in _EXPECTED:
        return ConfigurationError(f"Settings: {problem['msg']}")
    expected, where = _EXPECTED[field], ""
    if field in given:
        name = f"Settings.load({field}=...)"
    else:
        name = PREFIX + field.upper()
        if env_file is not None and name not in os.environ:
            where = f" (in {os.fspath(env_file)!r})"  # type: ignore[call-overload]
    if field in _SECRET:
        # Our own validator's reason never quotes the value; pydantic's messages are not shown.
        error_ = (problem.get("ctx") or {}).get("error")
        why = f": {error_}" if problem["type"] == "value_error" and error_ is not None else ""
        return ConfigurationError(
            f"{name}{where}: expected {expected} (the value is secret: not shown){why}"
        )
    value = given[field] if field in given else _raw(field, env_file)
    return ConfigurationError(f"{name}={value!r}{where}: expected {expected}")


def _raw(field: str, env_file: object) -> str | None:
    """The text the environment (or the env file) gave ``field``, to quote it (never
    called for a secret)."""
    name = PREFIX + field.upper()
    if name in os.environ:
        return os.environ[name]
    if env_file is not None:
        from dotenv import dotenv_values

        for key, value in dotenv_values(env_file).items():  # type: ignore[arg-type]
            if key.upper() == name:
                return value
    return None
