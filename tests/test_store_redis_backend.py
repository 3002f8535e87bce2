"""The Redis backend against a real redis-server: its contract (remote_backend.py), bounded time, faults as
RemoteError."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gearcache.errors import RemoteError
from gearcache.store.remote import open_backend
from gearcache.errors import ConfigError
from redis_server import free_port


def test_values_commit_and_scan(redis):
    b = open_backend(redis.url, timeout_s=2)
    assert b.get_many(["p:a", "p:b"]) == [None, None]
    b.put_temporary({"p:c0": b"x" * 10, "p:c1": b"y"}, ttl_s=60)
    assert redis.client().pttl("p:c0") > 0                          # expiring until committed
    b.commit("p:head", b"H", ["p:c0", "p:c1"])
    assert b.get_many(["p:head", "p:c0", "p:c1"]) == [b"H", b"x" * 10, b"y"]
    assert redis.client().pttl("p:c0") == -1                         # permanent now
    assert sorted(b.scan("p:")) == ["p:c0", "p:c1", "p:head"]
    assert list(b.scan("p:*")) == []                                 # the prefix is literal, not a pattern
    b.delete(["p:c0", "p:head"])
    assert b.get("p:head") is None and b.get("p:c1") == b"y"


def test_commit_of_an_expired_part_changes_nothing(redis):
    b = open_backend(redis.url, timeout_s=2)
    b.put_temporary({"p:c0": b"x"}, ttl_s=0.05)
    time.sleep(0.2)
    with pytest.raises(RemoteError, match="expired or was evicted"):
        b.commit("p:head", b"H", ["p:c0"])
    assert b.get("p:head") is None


def test_claims(redis):
    b = open_backend(redis.url, timeout_s=2)
    assert b.claim("p:claim", "h/1", ttl_s=5) is None
    assert b.claim("p:claim", "h/2", ttl_s=5) == "h/1"               # the holder is named
    assert b.refresh_claim("p:claim", "h/1", ttl_s=5) and not b.refresh_claim("p:claim", "h/2", ttl_s=5)
    b.release_claim("p:claim", "h/2")                                      # not the holder: nothing happens
    assert b.claim("p:claim", "h/2", ttl_s=5) == "h/1"
    b.release_claim("p:claim", "h/1")
    assert b.claim("p:claim", "h/2", ttl_s=0.1) is None
    time.sleep(0.3)                                                  # a holder that stops refreshing loses it
    assert not b.refresh_claim("p:claim", "h/2", ttl_s=5)
    assert b.claim("p:claim", "h/3", ttl_s=5) is None


def test_server_down_is_a_prompt_remote_error():
    b = open_backend(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="MGET failed"):
        b.get("k")
    assert time.monotonic() - t0 < 1.5


def test_slow_server_times_out_within_the_bound(redis):
    b = open_backend(redis.url, timeout_s=0.5)
    b.get("k")                                                       # connected before the server stalls
    sleeper = threading.Thread(target=lambda: redis.client(socket_timeout=10).execute_command("DEBUG", "SLEEP", 2))
    sleeper.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="Timeout"):
        b.get("k")
    assert time.monotonic() - t0 < 1.2
    sleeper.join()
    assert b.get("k") is None                                        # reconnects once the server answers


def test_full_server_is_a_remote_error(redis):
    b = open_backend(redis.url, timeout_s=2)
    redis.client().config_set("maxmemory", 1)                        # noeviction (the default policy): writes fail
    with pytest.raises(RemoteError, match="OOM|maxmemory"):
        b.put_temporary({"p:c0": b"x" * 1000}, ttl_s=60)


def test_reads_never_import_redis_py_and_writes_need_it(redis):
    """A node that only fetches (``get_many``) runs without redis-py (~0.1 s to import); the first write, claim or
    scan opens it, and without it is a RemoteError naming the fix."""
    redis.client().set("p:k", b"v")
    code = textwrap.dedent(f"""
        import sys
        from gearcache.errors import RemoteError
        from gearcache.store.remote import open_backend
        b = open_backend({redis.url!r}, timeout_s=2)
        assert b.get_many(["p:k", "p:none"]) == [b"v", None]
        assert "redis" not in sys.modules, "the read imported redis-py"
        sys.modules["redis"] = None                       # as if redis-py were not installed
        try:
            b.claim("p:claim", "h/1", ttl_s=5)
        except RemoteError as exc:
            print(exc)
        assert b.get("p:k") == b"v"
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "redis-py is not installed. Fix: pip install 'gearcache[fleet]'" in proc.stdout


def test_url_options_are_read_through_redis_py(redis):
    b = open_backend(redis.url + "?socket_keepalive=true", timeout_s=2)
    assert b._reader is None                                         # the small reader knows no URL options
    b.put_temporary({"p:a": b"x"}, ttl_s=60)
    assert b.get_many(["p:a", "p:b"]) == [b"x", None]


def test_unknown_scheme_is_a_config_error():
    with pytest.raises(ConfigError, match=r"remote='memcached://x'.*redis://"):
        open_backend("memcached://x", timeout_s=1)
