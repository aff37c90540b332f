"""What the controller must not forget across a restart: registered functions.

SQLite, one row per function (its spec as JSON). Calls are small and rare, so they run on a
thread with a fresh connection each time rather than holding a connection across threads.

Durability: WAL with ``synchronous=FULL``, so a commit is on disk (the WAL fsynced) before
:meth:`FunctionTable.upsert` returns and the controller acknowledges the registration
(``NORMAL`` may lose the last commits on power loss). A row that cannot be read back is
skipped, logged and counted, never fatal: one bad row must not crash-loop the controller.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prometheus_client import Counter

from flashpoint.log import get_logger
from flashpoint.spec import FunctionSpec

log = get_logger(__name__)

BAD_ROWS = Counter("flashpoint_controller_function_rows_skipped_total",
                   "Stored function rows that could not be read back at start (skipped)")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS functions (
    name TEXT PRIMARY KEY,
    spec_json TEXT NOT NULL,
    updated_s REAL NOT NULL DEFAULT (strftime('%s','now'))
);
"""


class FunctionTable:
    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """A connection for one transaction: committed (durably) on a clean exit, rolled
        back on an error, closed either way."""
        conn = sqlite3.connect(self.path, timeout=10.0)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            with conn:
                yield conn
        finally:
            conn.close()

    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

        def _init() -> None:
            with self._connect() as conn:
                conn.executescript(_SCHEMA)

        await asyncio.to_thread(_init)

    async def load(self) -> list[FunctionSpec]:
        """Every stored function that reads back as a valid spec; the others are skipped,
        each logged (``function_row_skipped``) and counted."""
        def _load() -> list[tuple[object, object]]:
            with self._connect() as conn:
                return list(conn.execute("SELECT name, spec_json FROM functions ORDER BY name"))

        specs = []
        for name, text in await asyncio.to_thread(_load):
            try:
                if not isinstance(text, (str, bytes)):
                    raise ValueError(f"spec_json is {type(text).__name__}, not text")
                specs.append(FunctionSpec.from_dict(json.loads(text)))
            except Exception as exc:  # noqa: BLE001 - any bad row is skipped, never fatal
                BAD_ROWS.inc()
                log.error("function_row_skipped", function=str(name)[:200], path=str(self.path),
                          error=f"{type(exc).__name__}: {exc}"[:300])
        return specs

    async def upsert(self, spec: FunctionSpec) -> None:
        def _upsert() -> None:
            with self._connect() as conn:
                conn.execute(
                    "INSERT INTO functions(name, spec_json) VALUES(?, ?) "
                    "ON CONFLICT(name) DO UPDATE SET spec_json=excluded.spec_json",
                    (spec.name, json.dumps(spec.to_dict())),
                )

        await asyncio.to_thread(_upsert)

    async def delete(self, name: str) -> None:
        def _delete() -> None:
            with self._connect() as conn:
                conn.execute("DELETE FROM functions WHERE name = ?", (name,))

        await asyncio.to_thread(_delete)
