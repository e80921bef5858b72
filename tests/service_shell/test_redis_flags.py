"""service_shell/redis_flags.py: the one place both services turn Redis flags into the page
store's settings (pagestore.RedisSettings); every inconsistent setting is refused naming its
flag."""
from __future__ import annotations

import argparse

import pytest

from service_shell.redis_flags import add_redis_flags, read_key_file, settings_from_args


def parse(*argv: str, mac_key: bool = True):
    p = argparse.ArgumentParser()
    add_redis_flags(p, "L3", mac_key=mac_key)
    args = p.parse_args(list(argv))
    return settings_from_args(p, args), args


def test_cluster_from_the_scheme_or_the_flag():
    s, _ = parse("--redis-url", "redis+cluster://h:7000")
    assert s.cluster and s.scheme == "redis" and s.plain_url() == "redis://h:7000"
    s, _ = parse("--redis-url", "redis://h:7000", "--redis-cluster")
    assert s.cluster and s.plain_url() == "redis://h:7000"
    s, _ = parse("--redis-url", "rediss+cluster://h:7000")
    assert s.cluster and s.scheme == "rediss"
    assert parse()[0] is None


def test_password_file_and_key_file(tmp_path):
    pw, key = tmp_path / "pw", tmp_path / "key"
    pw.write_text("the-password\n")
    key.write_text("k" * 32 + "\n")
    s, args = parse("--redis-url", "redis://prefixcache@h/0", "--redis-password-file", str(pw),
                    "--l3-mac-key-file", str(key))
    assert s.client_kwargs()["password"] == "the-password" and "the-password" not in repr(s)
    assert args.l3_mac_key == b"k" * 32
    (tmp_path / "short").write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        read_key_file(str(tmp_path / "short"), "--l3-mac-key-file")


@pytest.mark.parametrize("argv,message", [
    (["--redis-url", "http://h/0"], "scheme 'http'"),
    (["--redis-url", "redis://h/0", "--redis-tls-ca", "ca.crt"], "rediss://"),
    (["--redis-url", "rediss://h/0", "--redis-tls-cert", "c.crt"], "--redis-tls-key"),
    (["--redis-url", "redis://:pw@h/0", "--redis-password-file", "/dev/null"], "one place"),
    (["--redis-url", "redis://h/0", "--redis-password-file", "/nope"], "no such file"),
    (["--redis-url", "redis://h/0", "--l3-mac-key-file", "/nope"], "no such file"),
    (["--l3-mac-key-file", "/nope"], "needs --redis-url"),
    (["--redis-tls-ca", "ca.crt"], "needs --redis-url"),
])
def test_inconsistent_settings_are_usage_errors_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err
