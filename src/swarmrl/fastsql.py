"""Hot statements handed to SQLite's driver directly.

SQLAlchemy Core spends ~20 µs of Python on each statement it runs (the compiled cache's
lookup, the parameters' construction, the result's set-up) where SQLite itself spends ~5, and
each heartbeat, lease and submission runs several. A :class:`Fast` statement is compiled once
per database dialect; on SQLite (Python's ``sqlite3``) each run gives the driver the compiled
SQL and its positional parameters on the caller's connection, inside the caller's transaction
(the transaction is begun through SQLAlchemy first, so the caller's ``commit`` commits it).
Anything else runs through SQLAlchemy unchanged: another database or driver, a statement with
expanding ``IN`` parameters or one with values SQLAlchemy computes at each run (column
defaults). The column types' conversions (a boolean stored as an integer) are applied as
SQLAlchemy applies them, and the driver's errors are raised as SQLAlchemy's. Rows are named
tuples, read by attribute as SQLAlchemy's rows are.

An engine (or connection) carrying the execution options :data:`PUBLIC_PATH` runs every
statement through SQLAlchemy (``pool.fast_sql = false``).

Used by the pool's hot routes and the ledger's append. Knows nothing about the tables.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa

Params = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None
_OPTION = "swarmrl_fast_sql"
PUBLIC_PATH = {_OPTION: False}  # execution options: no statement goes to the driver directly


class Fast:
    """``stmt`` run by :meth:`run` as the module's text says."""

    def __init__(self, stmt: sa.Executable) -> None:
        self.stmt = stmt
        # an insert or update compiles to the columns given: one plan per set of them
        self._by_columns = isinstance(stmt, sa.Insert | sa.Update)
        # (dialect name, columns given) → plan; None: run through SQLAlchemy
        self._plans: dict[tuple[str, tuple[str, ...]], _Plan | None] = {}

    def run(self, conn: sa.Connection, params: Params = None) -> Any:
        """The result of ``stmt`` with ``params`` (a list of them: run once per item) on
        ``conn``: a :class:`FastResult` on SQLite, SQLAlchemy's result elsewhere."""
        first = params[0] if isinstance(params, Sequence) and params else params
        columns = tuple(sorted(first or ())) if self._by_columns else ()
        direct = conn.get_execution_options().get(_OPTION, True)
        key = (conn.dialect.name if direct else "", columns)
        if key not in self._plans:
            sqlite = key[0] == "sqlite" and conn.dialect.driver == "pysqlite"
            self._plans[key] = _plan(self.stmt, conn.dialect, columns) if sqlite else None
        plan = self._plans[key]
        if plan is None:
            return conn.execute(self.stmt, params)  # type: ignore[arg-type]
        if not conn.in_transaction():
            conn.begin()  # so that the caller's commit commits what the driver does
        driver = conn.connection.driver_connection
        assert driver is not None
        values: Any = (
            [plan.values(p) for p in params]
            if isinstance(params, Sequence)
            else plan.values(params or {})
        )
        try:
            if isinstance(params, Sequence):
                cursor = driver.executemany(plan.sql, values)
            else:
                cursor = driver.execute(plan.sql, values)
        except conn.dialect.loaded_dbapi.Error as exc:  # as SQLAlchemy raises it (IntegrityError…)
            dbapi_error = conn.dialect.loaded_dbapi.Error
            raise sa.exc.DBAPIError.instance(plan.sql, values, exc, dbapi_error) from exc
        return FastResult(cursor, plan)


class _Plan:
    def __init__(
        self,
        sql: str,
        names: list[str],
        defaults: dict[str, Any],
        binds: list[Any],
        results: list[Any],
    ) -> None:
        self.sql, self.names, self.defaults = sql, names, defaults
        # SQLAlchemy's conversions, position by position (None: the value as it is)
        self.binds = binds if any(binds) else None
        self.results = results if any(results) else None
        self.row_type: type | None = None

    def values(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        try:
            values = [params[n] if n in params else self.defaults[n] for n in self.names]
        except KeyError as exc:
            missing = sa.exc.InvalidRequestError(f"no value for bound parameter {exc.args[0]!r}")
            raise sa.exc.StatementError(str(missing), self.sql, dict(params), missing) from None
        if self.binds is not None:
            values = [
                v if f is None or v is None else f(v)
                for f, v in zip(self.binds, values, strict=True)
            ]
        return tuple(values)

    def row(self, description: Any, raw: tuple[Any, ...]) -> Any:
        if self.row_type is None:
            self.row_type = namedtuple("Row", [d[0] for d in description], rename=True)  # type: ignore[misc]
        if self.results is not None:
            raw = tuple(v if f is None else f(v) for f, v in zip(self.results, raw, strict=True))
        return self.row_type._make(raw)


def _plan(stmt: sa.Executable, dialect: sa.Dialect, columns: tuple[str, ...]) -> _Plan | None:
    compiled: Any = stmt.compile(dialect=dialect, column_keys=list(columns) or None)
    if compiled.positiontup is None or getattr(compiled, "post_compile_params", None):
        return None
    # values SQLAlchemy computes at each run (column defaults) are its to compute
    if getattr(compiled, "insert_prefetch", None) or getattr(compiled, "update_prefetch", None):
        return None
    names = list(compiled.positiontup)
    binds = [compiled.binds[n] for n in names]
    if any(b.callable is not None for b in binds):
        return None
    selected = getattr(stmt, "selected_columns", None) or getattr(stmt, "_returning", ())
    results = [getattr(c, "type", sa.types.NULLTYPE) for c in selected]
    # values fixed in the statement itself (``where(col == "x")``); required ones have none
    defaults = {n: b.value for n, b in compiled.binds.items() if not b.required}
    return _Plan(
        compiled.string,
        names,
        defaults,
        [b.type.bind_processor(dialect) for b in binds],
        [t.result_processor(dialect, None) for t in results],
    )


class FastResult:
    """What SQLAlchemy's result offers the hot routes: ``first``, ``scalar``, ``one``,
    ``scalar_one``, ``all``, iteration and ``rowcount``."""

    def __init__(self, cursor: Any, plan: _Plan) -> None:
        self.cursor, self.plan = cursor, plan

    @property
    def rowcount(self) -> int:
        return int(self.cursor.rowcount)

    def first(self) -> Any:
        raw = self.cursor.fetchone()
        self.cursor.close()
        return None if raw is None else self.plan.row(self.cursor.description, raw)

    def scalar(self) -> Any:
        row = self.first()
        return None if row is None else row[0]

    def one(self) -> Any:
        rows = self.all()
        if len(rows) != 1:
            raise sa.exc.NoResultFound("no row") if not rows else sa.exc.MultipleResultsFound()
        return rows[0]

    def scalar_one(self) -> Any:
        return self.one()[0]

    def all(self) -> list[Any]:
        rows = [self.plan.row(self.cursor.description, raw) for raw in self.cursor.fetchall()]
        self.cursor.close()
        return rows

    def __iter__(self) -> Iterator[Any]:
        return iter(self.all())
