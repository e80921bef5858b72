"""pagestore/settings.py: no password reaches a log line, and the start-up check names the cause
of an unreachable Redis (the flags that build the settings: tests/service_shell/test_redis_flags.py)."""
from __future__ import annotations

import pytest

from pagestore.settings import RedisSettings, redact


@pytest.mark.parametrize("url,shown", [
    ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
    ("rediss://prefixcache:s3cret@h:6380/0", "rediss://prefixcache:***@h:6380/0"),
    ("redis://prefixcache@h:6379/0", "redis://prefixcache@h:6379/0"),
    ("redis+cluster://u:p@h:7000", "redis+cluster://u:***@h:7000"),
])
def test_redact_hides_only_the_password(url, shown):
    assert redact(url) == shown and RedisSettings(url).redacted() == shown
    assert "s3cret" not in repr(RedisSettings(url).redacted())


def test_check_reports_the_cause_of_an_unreachable_redis():
    cause = RedisSettings("redis://:s3cret-pass@127.0.0.1:1/0").check(0.5)
    assert cause and "ConnectionError" in cause and "s3cret-pass" not in cause
