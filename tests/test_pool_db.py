"""The pool database's SQLite engine: a thread running one transaction after another keeps one
connection (so its page cache stays valid), and that cache holds the hot tables' pages."""

from swarmrl.pool.state.db import SQLITE_CACHE_KIB, make_engine, sqlite_url


def test_one_transaction_after_another_uses_the_connection_returned_last(tmp_path):
    engine = make_engine(sqlite_url(tmp_path / "pool.db"))
    try:
        with engine.connect() as first, engine.connect() as second:  # two in the pool now
            assert first.connection.driver_connection is not second.connection.driver_connection
        used = []
        for _ in range(4):
            with engine.begin() as conn:
                used.append(conn.connection.driver_connection)
                (pages,) = conn.exec_driver_sql("PRAGMA cache_size").one()
                assert pages == -SQLITE_CACHE_KIB  # negative: KiB, not pages
        assert all(c is used[0] for c in used)
    finally:
        engine.dispose()
