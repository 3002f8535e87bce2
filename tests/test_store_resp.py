"""The fetch path's Redis reader (gearcache/store/resp.py) against real redis-servers: URLs read as redis-py reads
them, values byte for byte, password, user and database, unix sockets, and every fault an ``OSError`` within the
timeout (down, slow, killed mid-reply, error replies, replies that break the protocol); pooled connections are
never shared by threads nor reused after a fault or a fork."""
from __future__ import annotations

import io
import os
import socket
import threading
import time

import pytest

from gearcache.store import resp
from gearcache.store.resp import Reader, ReplyError, Target, parse_url, read_reply
from redis_server import RedisServer, free_port


def reader(url: str, timeout_s: float = 2) -> Reader:
    target = parse_url(url)
    assert target is not None, url
    return Reader(target, timeout_s)


# ----------------------------------------------------------------------------------------------------- URLs
@pytest.mark.parametrize("url, target", [
    ("redis://h:7/3", Target("h", 7, None, 3, None, None)),
    ("redis://h", Target("h", 6379, None, 0, None, None)),
    ("redis://", Target("localhost", 6379, None, 0, None, None)),
    ("redis://h/2?db=5", Target("h", 6379, None, 5, None, None)),                # the query wins, as in redis-py
    ("redis://:p%40ss@h:7/0", Target("h", 7, None, 0, None, "p@ss")),
    ("redis://u:pw@h:7/0", Target("h", 7, None, 0, "u", "pw")),
    ("unix:///run/redis.sock?db=4", Target("", 0, "/run/redis.sock", 4, None, None)),
])
def test_urls_are_read_as_redis_py_reads_them(url, target):
    assert parse_url(url) == target


@pytest.mark.parametrize("url", ["rediss://h:7/0", "redis://h:7/0?ssl_cert_reqs=none", "redis://u@h:7/0",
                                 "redis://h:7/x", "redis://h:99999/0", "unix://", "http://h/0"])
def test_urls_it_does_not_handle_are_left_to_redis_py(url):
    assert parse_url(url) is None


# --------------------------------------------------------------------------------------------------- values
def test_values_byte_for_byte(redis):
    client = redis.client()
    values = {"k:crlf": b"a\r\nb\r\n", "k:empty": b"", "k:big": os.urandom(5 << 20) + b"\r\n"}
    client.mset(values)
    r = reader(redis.url)
    assert r.mget(["k:crlf", "k:none", "k:empty", "k:big"]) == [values["k:crlf"], None, b"", values["k:big"]]
    assert r.command("GET", "k:none") is None and r.command("EXISTS", "k:crlf") == 1
    assert r.command("PING") == b"PONG"


def test_password_user_and_database(tmp_path):
    server = RedisServer(args=("--requirepass", "s3cret")).start()
    try:
        client = server.client()
        client.execute_command("ACL", "SETUSER", "fleet", "on", ">pw2", "~*", "+@all")
        server.client(db=3).set("k", b"in db 3")
        port = server.port
        assert reader(f"redis://:s3cret@127.0.0.1:{port}/3").mget(["k"]) == [b"in db 3"]
        assert reader(f"redis://fleet:pw2@127.0.0.1:{port}/0?db=3").mget(["k"]) == [b"in db 3"]
        assert reader(f"redis://:s3cret@127.0.0.1:{port}/0").mget(["k"]) == [None]
        with pytest.raises(ReplyError, match="WRONGPASS|invalid"):
            reader(f"redis://:wrong@127.0.0.1:{port}/0").mget(["k"])
        with pytest.raises(ReplyError, match="NOAUTH"):
            reader(f"redis://127.0.0.1:{port}/0").mget(["k"])
    finally:
        server.stop()


def test_unix_socket(tmp_path):
    sock = str(tmp_path / "redis.sock")
    server = RedisServer(args=("--unixsocket", sock, "--unixsocketperm", "700")).start()
    try:
        server.client(db=2).set("k", b"v")
        assert reader(f"unix://{sock}?db=2").mget(["k", "x"]) == [b"v", None]
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------- faults
def test_server_down_is_a_prompt_oserror():
    r = reader(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        r.mget(["k"])
    assert time.monotonic() - t0 < 1.5


def test_slow_server_times_out_and_the_connection_is_not_reused(redis):
    r = reader(redis.url, timeout_s=0.5)
    assert r.mget(["k"]) == [None]
    sleeper = threading.Thread(target=lambda: redis.client(socket_timeout=10).execute_command("DEBUG", "SLEEP", 1.5))
    sleeper.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        r.mget(["k"])
    assert time.monotonic() - t0 < 1.0 and r._idle == []           # closed: its late reply is never read
    sleeper.join()
    redis.client().set("k", b"fresh")
    assert r.mget(["k"]) == [b"fresh"]                                # a new connection, in step with the server


def test_server_killed_mid_reply_is_a_connection_error(redis):
    redis.client().set("k", os.urandom(64 << 20))
    r = reader(redis.url, timeout_s=5)
    assert r.mget(["nothing"]) == [None]                             # connected
    killer = threading.Timer(0.02, redis.kill)
    killer.start()
    with pytest.raises(OSError):                                      # reset, or closed mid-reply
        for _ in range(100):
            r.mget(["k"])
    killer.join()                                                     # reaped: the fixture restarts the server
    assert r._idle == []


def test_error_reply_is_a_reply_error(redis):
    redis.client().hset("h", "f", "v")
    r = reader(redis.url)
    with pytest.raises(ReplyError, match="WRONGTYPE"):
        r.command("GET", "h")
    with pytest.raises(ReplyError, match="unknown command"):
        r.command("NOSUCHCOMMAND")


@pytest.mark.parametrize("raw, error", [
    (b"$5\r\nab", ConnectionError),                                   # the stream ends mid-value
    (b"", ConnectionError),
    (b"$3\r\nabcXY", ReplyError),                                     # a value not ended by CRLF
    (b"$x\r\n", ReplyError),
    (b"$%d\r\n" % (resp.MAX_BULK + 1), ReplyError),                   # larger than Redis can store: never allocated
    (b"*1\r\n*1\r\n$1\r\na\r\n\r\n", ReplyError),                     # nested arrays: not a reply of GET or MGET
    (b"?what\r\n", ReplyError),
    (b"+ok\n", ReplyError),
    (b"+" + b"x" * (70 << 10) + b"\r\n", ReplyError),                # an endless line
])
def test_replies_that_break_the_protocol_are_errors(raw, error):
    with pytest.raises(error):
        read_reply(io.BufferedReader(io.BytesIO(raw)))


def lying_server(reply: bytes) -> str:
    """A URL whose server answers every command with ``reply``: what no real redis-server sends (a hostile one could).
    Serves one connection."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            while conn.recv(65536):
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


@pytest.mark.parametrize("reply", [b"*1\r\n$8\r\nonly one\r\n", b":7\r\n", b"*2\r\n:1\r\n$-1\r\n"])
def test_mget_reply_of_another_shape_is_a_reply_error_and_drops_the_connection(reply):
    """Fewer values than keys, an integer, an integer among the values."""
    r = reader(lying_server(reply))
    with pytest.raises(ReplyError, match="does not match"):
        r.mget(["a", "b"])
    assert r._idle == []


# ---------------------------------------------------------------------------------------- threads and fork
def test_threads_never_share_a_connection(redis):
    client = redis.client()
    client.mset({f"k{i}": str(i).encode() * 1000 for i in range(8)})
    r = reader(redis.url)
    wrong = []

    def work(i: int) -> None:
        for _ in range(50):
            if r.mget([f"k{i}", "none"]) != [str(i).encode() * 1000, None]:
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and 1 <= len(r._idle) <= 8


def test_a_forked_child_opens_its_own_connection(redis):
    redis.client().set("k", b"v")
    r = reader(redis.url)
    assert r.mget(["k"]) == [b"v"]
    parent_port = r._idle[0].sock.getsockname()[1]
    pid = os.fork()
    if pid == 0:                                                      # the child: exit status tells the parent
        ok = r.mget(["k"]) == [b"v"] and r._idle[0].sock.getsockname()[1] != parent_port
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert r.mget(["k"]) == [b"v"] and r._idle[0].sock.getsockname()[1] == parent_port
