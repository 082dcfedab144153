from __future__ import annotations

import pytest

from ttsq.config import Settings, is_sentinel_url, parse_sentinel_url
from ttsq.errors import ConfigError


def test_defaults_are_valid_and_concurrency_is_twice_the_batch() -> None:
    settings = Settings.from_env({})
    assert settings.engine == "espeak"
    assert settings.concurrency == 2 * settings.max_batch


def test_environment_is_read_and_flags_win() -> None:
    env = {"TTSQ_MAX_BATCH": " 16 ", "TTSQ_ENGINE": "espeak", "TTSQ_STORAGE_URL": "s3://bucket/prefix"}
    settings = Settings.from_env(env, max_wait_ms=5)
    assert (settings.max_batch, settings.max_wait_ms, settings.storage_url) == (16, 5, "s3://bucket/prefix")
    assert Settings.from_env(env, max_batch=2).max_batch == 2


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"TTSQ_MAX_BATCH": "eight"}, "TTSQ_MAX_BATCH"),
        ({"TTSQ_MAX_BATCH": "0"}, "TTSQ_MAX_BATCH"),
        ({"TTSQ_MAX_WAIT_MS": "-1"}, "TTSQ_MAX_WAIT_MS"),
        ({"TTSQ_URL_EXPIRY_S": "999999999"}, "TTSQ_URL_EXPIRY_S"),
        ({"TTSQ_BROKER_URL": "amqp://localhost"}, "TTSQ_BROKER_URL"),
        ({"TTSQ_STORAGE_URL": "s3://x"}, "TTSQ_STORAGE_URL"),
        ({"TTSQ_LOG_LEVEL": "LOUD"}, "TTSQ_LOG_LEVEL"),
        # a job still waiting when Redis redelivers it would run twice
        ({"TTSQ_VISIBILITY_TIMEOUT_S": "60", "TTSQ_JOB_TIMEOUT_S": "60"}, "TTSQ_JOB_TIMEOUT_S"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env)
    assert info.value.variable == variable
    assert str(info.value).startswith(variable)


def test_settings_are_frozen() -> None:
    settings = Settings()
    with pytest.raises(AttributeError):
        settings.max_batch = 3  # type: ignore[misc]
    assert settings.replace(max_batch=3).max_batch == 3


def test_log_level_is_normalized_for_logging() -> None:
    assert Settings.from_env({"TTSQ_LOG_LEVEL": "debug"}).log_level == "DEBUG"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("TTSQ_CACHE_URL", "redis://host:notaport/2"),
        ("TTSQ_RESULT_BACKEND", "redis://host:6379/one"),
        ("TTSQ_S3_ENDPOINT_URL", "minio:9000"),
        ("TTSQ_S3_PUBLIC_ENDPOINT_URL", "http://host:port"),
    ],
)
def test_malformed_urls_are_refused_at_startup(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({variable: value})
    assert info.value.variable == variable


def test_unknown_override_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        Settings.from_env({}, max_bacth=3)


def test_a_visibility_timeout_a_healthy_job_could_outlive_is_refused_at_startup() -> None:
    # 60 s job timeout + 2 storage tries x (check + PUT) x (connect + read) of 10 s + 0.5 s pause = 140.5 s
    env = {
        "TTSQ_JOB_TIMEOUT_S": "60",
        "TTSQ_STORAGE_ATTEMPTS": "2",
        "TTSQ_STORAGE_TIMEOUT_S": "10",
        "TTSQ_STORAGE_BACKOFF_MS": "500",
    }
    settings = Settings.from_env({**env, "TTSQ_VISIBILITY_TIMEOUT_S": "176"})
    assert settings.worst_unacked_s == 140.5 and settings.min_visibility_timeout_s == 176
    with pytest.raises(ConfigError) as info:
        Settings.from_env({**env, "TTSQ_VISIBILITY_TIMEOUT_S": "175"})
    assert info.value.variable == "TTSQ_VISIBILITY_TIMEOUT_S"
    assert "at least 176 s" in str(info.value)


def test_the_batch_limit_leaves_a_job_time_for_the_batch_ahead_of_it() -> None:
    assert Settings(job_timeout_s=600).batch_limit_s == 300
    assert Settings(job_timeout_s=600, batch_timeout_s=30).batch_limit_s == 30
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"TTSQ_JOB_TIMEOUT_S": "600", "TTSQ_BATCH_TIMEOUT_S": "301"})
    assert info.value.variable == "TTSQ_BATCH_TIMEOUT_S"


def test_storage_backoff_doubles_up_to_its_cap() -> None:
    settings = Settings(storage_backoff_ms=1000, storage_attempts=8, visibility_timeout_s=3600)
    assert [settings.storage_backoff_s(retry) for retry in range(7)] == [1, 2, 4, 8, 16, 30, 30]


@pytest.mark.parametrize("name", ["TTSQ_MAX_ATTEMPTS", "TTSQ_STORAGE_ATTEMPTS", "TTSQ_STORAGE_TIMEOUT_S"])
def test_retry_settings_must_be_positive(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({name: "0"})
    assert info.value.variable == name


# --- Redis behind Sentinel -------------------------------------------------------------------------

SENTINELS = "sentinel://:data-pw@10.0.0.1:26379;sentinel://10.0.0.2:26380;sentinel://10.0.0.3/2"


def test_a_sentinel_url_is_taken_apart_and_written_the_way_celery_reads_it() -> None:
    settings = Settings.from_env({"TTSQ_CACHE_URL": SENTINELS, "TTSQ_REDIS_MASTER_NAME": "ttsq"})
    parsed = parse_sentinel_url(settings.cache_url)
    assert parsed.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379))
    assert (parsed.db, parsed.username, parsed.password) == (2, None, "data-pw")
    # kombu and Celery read the database and the password from the first address only.
    assert parsed.for_celery() == (
        "sentinel://:data-pw@10.0.0.1:26379/2;sentinel://:data-pw@10.0.0.2:26380/2;sentinel://:data-pw@10.0.0.3:26379/2"
    )


@pytest.mark.parametrize(
    ("env", "variable", "words"),
    [
        # Where to ask, but not for what: the master's name is missing.
        ({"TTSQ_BROKER_URL": "sentinel://h1:26379;sentinel://h2:26379/0"}, "TTSQ_REDIS_MASTER_NAME", "BROKER_URL"),
        ({"TTSQ_RESULT_BACKEND": "sentinel://h1:26379/1"}, "TTSQ_REDIS_MASTER_NAME", "RESULT_BACKEND"),
        (
            {"TTSQ_CACHE_URL": "sentinel://h1:x;sentinel://h2/2", "TTSQ_REDIS_MASTER_NAME": "m"},
            "TTSQ_CACHE_URL",
            "port",
        ),
        ({"TTSQ_CACHE_URL": "sentinel://h1/1;sentinel://h2/2", "TTSQ_REDIS_MASTER_NAME": "m"}, "TTSQ_CACHE_URL", "two"),
        (
            {"TTSQ_CACHE_URL": "sentinel://h1;redis://h2/2", "TTSQ_REDIS_MASTER_NAME": "m"},
            "TTSQ_CACHE_URL",
            "address 2",
        ),
        ({"TTSQ_CACHE_URL": "sentinel://h1/two", "TTSQ_REDIS_MASTER_NAME": "m"}, "TTSQ_CACHE_URL", "number"),
        ({"TTSQ_REDIS_WAIT_REPLICAS": "-1"}, "TTSQ_REDIS_WAIT_REPLICAS", "0..16"),
        ({"TTSQ_REDIS_WAIT_TIMEOUT_MS": "0"}, "TTSQ_REDIS_WAIT_TIMEOUT_MS", "1..60000"),
    ],
)
def test_sentinel_settings_that_cannot_work_are_refused_at_start(
    env: dict[str, str], variable: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env)
    assert info.value.variable == variable
    assert words in str(info.value), str(info.value)


def test_plain_redis_urls_need_no_master_name() -> None:
    settings = Settings.from_env({"TTSQ_BROKER_URL": "redis://:pw@host:6379/0"})
    assert settings.redis_master_name == "" and not is_sentinel_url(settings.broker_url)
