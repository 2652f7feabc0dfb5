"""Hot statements handed to the database driver (swarmrl.fastsql) read and write exactly
what SQLAlchemy would, in the caller's transaction, and fail as SQLAlchemy fails."""

import pytest
import sqlalchemy as sa

from swarmrl.fastsql import Fast, FastResult
from swarmrl.pool.state import db
from swarmrl.pool.state.db import make_engine, sqlite_url

_c = db.credits
INSERT = Fast(_c.insert())
BY_NODE = Fast(sa.select(_c).where(_c.c.node_id == sa.bindparam("n")).order_by(_c.c.submission_id))
COUNT = Fast(sa.select(sa.func.count()).select_from(_c).where(_c.c.pool_id == "p"))
DROP = Fast(_c.update().where(_c.c.node_id == sa.bindparam("n")).values(dropped=True))
SOME = Fast(sa.select(_c.c.submission_id).where(_c.c.submission_id.in_(["a", "b"])))


def _credit(sid, node="n1", dropped=False):
    return dict(
        submission_id=sid,
        pool_id="p",
        node_id=node,
        tokens=7,
        created_at=1.5,
        unlock_at=2.5,
        dropped=dropped,
    )


@pytest.fixture
def engine(db_url, tmp_path):
    engine = make_engine(db_url or sqlite_url(tmp_path / "f.db"))
    yield engine
    engine.dispose()


def test_reads_and_writes_what_sqlalchemy_would(engine):
    with engine.begin() as conn:
        INSERT.run(conn, [_credit("a"), _credit("b", dropped=True)])
        INSERT.run(conn, _credit("c", node="n2"))
        # a column left out takes its default, as through SQLAlchemy
        INSERT.run(conn, {k: v for k, v in _credit("d", node="n3").items() if k != "dropped"})
    with engine.connect() as conn:
        fast = BY_NODE.run(conn, {"n": "n1"}).all()
        plain = conn.execute(BY_NODE.stmt, {"n": "n1"}).all()
        assert [tuple(r) for r in fast] == [tuple(r) for r in plain]
        assert [r.dropped for r in fast] == [False, True]  # booleans, not 0 and 1
        assert all(type(r.dropped) is bool for r in fast)
        assert fast[0].submission_id == "a" and fast[1].tokens == 7
        assert BY_NODE.run(conn, {"n": "n3"}).one().dropped is False
        assert BY_NODE.run(conn, {"n": "nobody"}).first() is None
        assert COUNT.run(conn).scalar_one() == 4 and COUNT.run(conn).scalar() == 4
        assert sorted(r.submission_id for r in SOME.run(conn)) == ["a", "b"]  # expanding IN
        with pytest.raises(sa.exc.NoResultFound):
            BY_NODE.run(conn, {"n": "nobody"}).one()
        with pytest.raises(sa.exc.MultipleResultsFound):
            BY_NODE.run(conn, {"n": "n1"}).one()


def test_runs_in_the_callers_transaction(engine):
    with engine.begin() as conn:
        INSERT.run(conn, [_credit("a"), _credit("b")])
    with engine.connect() as conn:  # first statement through the driver: the commit commits it
        assert DROP.run(conn, {"n": "n1"}).rowcount == 2
        conn.commit()
    with engine.connect() as conn:  # ... and closing without one rolls it back
        INSERT.run(conn, _credit("z"))
    with engine.connect() as conn:
        rows = BY_NODE.run(conn, {"n": "n1"}).all()
    assert [(r.submission_id, r.dropped) for r in rows] == [("a", True), ("b", True)]


def test_fails_as_sqlalchemy_fails(engine):
    with engine.begin() as conn:
        INSERT.run(conn, _credit("a"))
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        INSERT.run(conn, _credit("a"))
    with pytest.raises(sa.exc.StatementError), engine.connect() as conn:
        BY_NODE.run(conn, {})
    with engine.connect() as conn:
        assert COUNT.run(conn).scalar_one() == 1


def test_only_sqlite_goes_to_the_driver(engine):
    with engine.connect() as conn:
        result = COUNT.run(conn)
        assert isinstance(result, FastResult) == (engine.dialect.name == "sqlite")
        assert isinstance(SOME.run(conn), sa.CursorResult)  # expanding IN: SQLAlchemy's


def test_the_public_path_runs_every_statement_through_sqlalchemy(tmp_path):
    """``pool.fast_sql = false``: the same statements, the same rows, none through the driver."""
    fast, public = (
        make_engine(sqlite_url(tmp_path / f"{name}.db"), fast_sql=name == "fast")
        for name in ("fast", "public")
    )
    try:
        rows = {}
        for name, engine in (("fast", fast), ("public", public)):
            with engine.begin() as conn:
                INSERT.run(conn, [_credit("a"), _credit("b", dropped=True)])
                assert DROP.run(conn, {"n": "n1"}).rowcount == 2
            with engine.connect() as conn:
                result = BY_NODE.run(conn, {"n": "n1"})
                assert isinstance(result, FastResult) == (name == "fast")
                rows[name] = [tuple(r) for r in result.all()]
                assert isinstance(COUNT.run(conn), sa.CursorResult) == (name == "public")
        assert (
            rows["fast"]
            == rows["public"]
            == [("a", "p", "n1", 7, 1.5, 2.5, True)] + [("b", "p", "n1", 7, 1.5, 2.5, True)]
        )
    finally:
        fast.dispose()
        public.dispose()
