"""The servers of testbed (the fixtures of tests/servers.py) really serve: a
PostgreSQL database takes a table and a row, and Redis keeps a key across a restart through its
append-only file. The service tests trust these fixtures, so they are tested on their own
first."""

from __future__ import annotations

import time

import psycopg
import pytest
import redis

from testbed.servers import PostgresServer, RedisServer


def _psycopg_url(sqlalchemy_url: str) -> str:
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


def test_postgres_new_database_is_empty_and_writable(postgres_server: PostgresServer):
    url = postgres_server.new_database()
    assert url != postgres_server.new_database()  # unique names
    with psycopg.connect(_psycopg_url(url), autocommit=True) as connection:
        tables = "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
        assert connection.execute(tables).fetchone() == (0,)
        connection.execute("CREATE TABLE t (id serial PRIMARY KEY, name text)")
        connection.execute("INSERT INTO t (name) VALUES ('x')")
        assert connection.execute("SELECT name FROM t").fetchall() == [("x",)]
        assert connection.execute("SHOW server_version").fetchone()[0].startswith("15.")
    postgres_server.drop_database(url)
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(_psycopg_url(url), connect_timeout=2)


def test_postgres_restart_keeps_data(postgres_server: PostgresServer):
    url = postgres_server.new_database()
    with psycopg.connect(_psycopg_url(url), autocommit=True) as connection:
        connection.execute("CREATE TABLE kept (v int)")
        connection.execute("INSERT INTO kept VALUES (7)")
    postgres_server.restart()
    with psycopg.connect(_psycopg_url(url)) as connection:
        assert connection.execute("SELECT v FROM kept").fetchall() == [(7,)]


def test_redis_set_survives_restart_through_the_aof(redis_server: RedisServer):
    client = redis.Redis.from_url(redis_server.url)
    client.set("edge-un:kept", "yes")
    assert client.config_get("appendonly") == {"appendonly": "yes"}
    assert client.config_get("save") == {"save": ""}  # no RDB: only the AOF can bring it back
    port = redis_server.port
    redis_server.restart()
    assert redis_server.port == port
    assert redis.Redis.from_url(redis_server.url).get("edge-un:kept") == b"yes"


def test_redis_kill_stops_it_and_start_brings_it_back(redis_server: RedisServer):
    client = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    client.set("edge-un:before-kill", "1")
    client.execute_command("BGREWRITEAOF")  # on disk for sure, whatever the fsync second
    _wait_for_rewrite(client)
    redis_server.kill()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(redis_server.url, socket_timeout=2).ping()
    redis_server.start()
    assert redis.Redis.from_url(redis_server.url).get("edge-un:before-kill") == b"1"


def _wait_for_rewrite(client: redis.Redis, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = client.info("persistence")
        if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
            return
        time.sleep(0.05)
    raise AssertionError("BGREWRITEAOF did not finish")
