"""``gearcache push`` / ``pull`` and ``ls``/``inspect``/``verify``/``stats``/``prune --remote``
(gearcache/cli/remote.py) against a real redis-server, on the session's compiled seed folder."""
from __future__ import annotations

import json

import pytest

from conftest import FLEET_KEY, fleet_config, run_script
from gearcache.cli import main


def run(capsys, *argv) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.mark.slow
def test_push_pull_then_a_node_compiles_nothing(redis, seed, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GEARCACHE_SIGNING_KEY", FLEET_KEY)
    code, doc = run(capsys, "push", "--cache-dir", str(seed), "--remote", redis.url)
    assert code == 0 and (doc["entries"], doc["artifacts"]) == (1, 1)
    code, doc = run(capsys, "ls", "--remote", redis.url)
    assert code == 0 and len(doc["entries"]) == 1 and doc["entries"][0]["bytes"] > 0
    code, doc = run(capsys, "inspect", doc["entries"][0]["ekey"][:10], "--remote", redis.url)
    assert code == 0 and doc["artifact_head"]["chunks"] >= 1
    code, doc = run(capsys, "stats", "--remote", redis.url)
    assert (code, doc["entries"], doc["artifacts"]) == (0, 1, 1)
    code, doc = run(capsys, "verify", "--remote", redis.url)
    assert (code, doc["artifacts_ok"], doc["problems"]) == (0, 1, [])
    node = tmp_path / "node"
    code, doc = run(capsys, "pull", "--cache-dir", str(node), "--remote", redis.url)
    assert code == 0 and (doc["entries"], doc["artifacts"], doc["refused"]) == (1, 1, 0)
    report = run_script("fleet_node.py", str(node), fleet_config(None))          # serves with no remote at all
    assert (report["compiles"], report["traces"], report["loads"], report["equal"]) == (0, 0, 1, True)


def test_verify_and_prune_find_a_corrupted_remote_artifact(redis, seed, capsys, monkeypatch):
    monkeypatch.setenv("GEARCACHE_SIGNING_KEY", FLEET_KEY)
    assert run(capsys, "push", "--cache-dir", str(seed), "--remote", redis.url)[0] == 0
    client = redis.client()
    chunk = next(client.scan_iter(match="gearcache:*:chunk:*"))
    client.set(chunk, b"garbage")
    code, doc = run(capsys, "verify", "--remote", redis.url)
    assert code == 1 and len(doc["problems"]) == 2                 # the artifact, and the entry naming it
    code, doc = run(capsys, "prune", "--corrupt", "--remote", redis.url)
    assert code == 0 and client.get(doc["would_delete"][0]) is not None        # a dry run
    code, doc = run(capsys, "prune", "--corrupt", "--yes", "--remote", redis.url)
    assert code == 0 and len(doc["deleted"]) >= 3                  # head, entry, chunks
    assert list(client.scan_iter(match="gearcache:*")) == []


def test_remote_without_a_key_is_a_usage_error(redis, capsys, monkeypatch):
    monkeypatch.delenv("GEARCACHE_SIGNING_KEY", raising=False)
    assert main(["ls", "--remote", redis.url]) == 2
    assert "without a signing key" in capsys.readouterr().err
    assert main(["ls", "--remote", redis.url, "--remote-trust", "unsigned-ok"]) == 0
