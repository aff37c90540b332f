"""What the controller must not forget across a restart: registered functions.

SQLite, one row per function (its spec as JSON). Calls are small and rare, so they run on a
thread with a fresh connection each time rather than holding a connection across threads.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

from flashpoint.spec import FunctionSpec

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

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=10.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

        def _init() -> None:
            with self._connect() as conn:
                conn.executescript(_SCHEMA)

        await asyncio.to_thread(_init)

    async def load(self) -> list[FunctionSpec]:
        def _load() -> list[str]:
            with self._connect() as conn:
                return [r[0] for r in conn.execute("SELECT spec_json FROM functions ORDER BY name")]

        return [FunctionSpec.from_dict(json.loads(s)) for s in await asyncio.to_thread(_load)]

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
