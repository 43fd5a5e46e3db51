"""Settings: explicit code beats the environment, the environment beats the env file and
the defaults; secrets never shown; a bad value names its variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumerdedup import ConfigurationError
from consumerdedup.app.settings import Settings

SECRET = "s3cr3t-pw"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [
        "CONSUMERDEDUP_DATABASE_URL",
        "CONSUMERDEDUP_DB_URL",
        "CONSUMERDEDUP_WORKERS",
        "CONSUMERDEDUP_HEALTH_PORT",
        "CONSUMERDEDUP_RABBITMQ_URL",
        "CONSUMERDEDUP_LOG_LEVEL",
        "CONSUMERDEDUP_SHUTDOWN_TIMEOUT",
    ]:
        monkeypatch.delenv(name, raising=False)


def env_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "service.env"
    path.write_text(text)
    return path


def test_defaults() -> None:
    settings = Settings.load()
    assert settings.workers == 1 and settings.health_port is None
    assert settings.log_level == "INFO" and settings.log_format == "text"
    assert settings.shutdown_timeout == 30.0 and settings.database_url is None


def test_code_beats_environment_beats_env_file_beats_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = env_file(
        tmp_path,
        "CONSUMERDEDUP_WORKERS=2\nCONSUMERDEDUP_HEALTH_PORT=8001\n"
        "CONSUMERDEDUP_LOG_LEVEL=debug\nOTHER_SERVICE_SETTING=x\n",
    )
    monkeypatch.setenv("CONSUMERDEDUP_WORKERS", "3")
    monkeypatch.setenv("CONSUMERDEDUP_HEALTH_PORT", "8002")
    settings = Settings.load(path, workers=4, health_port=None)  # None: not given
    assert settings.workers == 4  # code
    assert settings.health_port == 8002  # the environment over the file
    assert settings.log_level == "DEBUG"  # the file over the default
    assert settings.shutdown_timeout == 30.0  # the default


def test_the_clis_database_variable_is_read_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONSUMERDEDUP_DB_URL", "sqlite:///a.db")
    assert Settings.load().secret("database_url") == "sqlite:///a.db"
    monkeypatch.setenv("CONSUMERDEDUP_DATABASE_URL", "sqlite:///b.db")
    assert Settings.load().secret("database_url") == "sqlite:///b.db"
    assert Settings.load(database_url="sqlite:///c.db").secret("database_url") == "sqlite:///c.db"


def test_secrets_are_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONSUMERDEDUP_DATABASE_URL", f"postgresql://app:{SECRET}@db/app")
    settings = Settings.load(rabbitmq_url=f"amqp://app:{SECRET}@mq/")
    assert SECRET not in repr(settings) and SECRET not in str(settings)
    assert SECRET not in repr(settings.model_dump()) and SECRET not in settings.model_dump_json()
    assert settings.secret("rabbitmq_url") == f"amqp://app:{SECRET}@mq/"


def test_a_bad_secret_value_is_not_quoted(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Settings.load(database_url=[f"postgresql://app:{SECRET}@db/app"])
    assert "database_url" in str(raised.value) and SECRET not in str(raised.value)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        (
            "CONSUMERDEDUP_WORKERS",
            "abc",
            "CONSUMERDEDUP_WORKERS='abc': expected an integer from 1 to 1024",
        ),
        (
            "CONSUMERDEDUP_WORKERS",
            "0",
            "CONSUMERDEDUP_WORKERS='0': expected an integer from 1 to 1024",
        ),
        ("CONSUMERDEDUP_HEALTH_PORT", "70000", "expected a port number from 1 to 65535"),
        ("CONSUMERDEDUP_SHUTDOWN_TIMEOUT", "-1", "expected a number of seconds > 0"),
        ("CONSUMERDEDUP_SHUTDOWN_TIMEOUT", "nan", "expected a number of seconds > 0"),
        ("CONSUMERDEDUP_LOG_LEVEL", "LOUD", "expected one of DEBUG, INFO"),
    ],
)
def test_a_bad_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=variable) as raised:
        Settings.load()
    assert expected in str(raised.value)


def test_a_bad_value_in_the_env_file_names_the_variable_and_the_file(tmp_path: Path) -> None:
    path = env_file(tmp_path, "CONSUMERDEDUP_WORKERS=many\n")
    with pytest.raises(ConfigurationError) as raised:
        Settings.load(path)
    said = str(raised.value)
    assert "CONSUMERDEDUP_WORKERS='many'" in said and str(path) in said


def test_a_misspelt_variable_in_the_env_file_is_refused(tmp_path: Path) -> None:
    path = env_file(tmp_path, "CONSUMERDEDUP_WORKER=4\n")
    with pytest.raises(ConfigurationError, match=r"CONSUMERDEDUP_WORKER in .* is not a setting"):
        Settings.load(path)


def test_a_missing_env_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="does not exist"):
        Settings.load(tmp_path / "nope.env")


@pytest.mark.parametrize(
    ("keyword", "value"),
    [("workers", "4"), ("workers", True), ("shutdown_timeout", 0), ("log_format", "xml")],
)
def test_a_bad_value_from_code_names_the_keyword(keyword: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=rf"Settings.load\({keyword}=...\)"):
        Settings.load(**{keyword: value})


def test_an_unknown_keyword_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="no setting 'worker'"):
        Settings.load(worker=2)
