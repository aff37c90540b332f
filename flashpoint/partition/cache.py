"""A small LRU of plan tables, keyed per model version and cost model (seed 004, §4.2.2, §8.7).

Plans depend only on the per-layer profiles (sizes, execution times, output sizes) and the
cost model. A new model version may change profiles, so the key holds the version; the
profiles' own fingerprint is checked on every hit too, so a caller that reuses a version
string with different profiles gets a fresh table, never a stale one.

Thread-safe (the controller builds tables off its event loop); a table is built outside
the lock, so two concurrent misses may both build — the second result wins, harmlessly.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from flashpoint.partition.model import CostModel, LayerProfile
from flashpoint.partition.table import PlanTable, plan_table


@dataclass(frozen=True)
class PlanKey:
    """What a cached table answers for."""

    model: str
    version: str
    cost_fingerprint: str
    p_max: int
    x_max: int
    P: int | None


def profiles_fingerprint(profiles: Sequence[LayerProfile]) -> str:
    """Stable short hash of the layer profiles (exact float bits)."""
    h = hashlib.sha256()
    for layer in profiles:
        h.update(f"{layer.name}\0{layer.bytes}\0{float(layer.exec_s).hex()}\0"
                 f"{layer.output_bytes}\n".encode())
    return h.hexdigest()[:16]


class PlanCache:
    """LRU of :class:`PlanTable` by (model, version, cost model fingerprint, table bounds)."""

    def __init__(self, max_entries: int = 8) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._tables: OrderedDict[PlanKey, tuple[str, PlanTable]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._tables)

    def get(self, model: str, version: str, profiles: Sequence[LayerProfile], cost: CostModel,
            *, p_max: int = 64, x_max: int = 3000, P: int | None = None) -> PlanTable:
        """The cached table for this model version, building it on a miss."""
        key = PlanKey(model, version, cost.fingerprint(), p_max, x_max, P)
        fp = profiles_fingerprint(profiles)
        with self._lock:
            entry = self._tables.get(key)
            if entry is not None and entry[0] == fp:
                self._tables.move_to_end(key)
                self.hits += 1
                return entry[1]
            self.misses += 1
        table = plan_table(profiles, cost, p_max=p_max, x_max=x_max, P=P)
        with self._lock:
            self._tables[key] = (fp, table)
            self._tables.move_to_end(key)
            while len(self._tables) > self.max_entries:
                self._tables.popitem(last=False)
        return table

    def drop(self, model: str, version: str | None = None) -> int:
        """Forget a model's tables (one version, or all); returns how many were dropped."""
        with self._lock:
            gone = [k for k in self._tables
                    if k.model == model and (version is None or k.version == version)]
            for k in gone:
                del self._tables[k]
        return len(gone)
