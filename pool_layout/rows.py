"""PoolRows: which pool row (layer) each attention module reads, assigned by one walk."""
from __future__ import annotations


class PoolRows:
    """`rows[kind][module]` from ONE walk over `(kind, module)` pairs, in walk order.

    The same walk tells sizing how many rows (layers) each kind's pool needs, so
    the pool and the modules cannot disagree. A module the walk never saw raises.
    """

    def __init__(self):
        self._rows: dict[str, dict[object, int]] | None = None

    def walk(self, pairs) -> "PoolRows":
        rows: dict[str, dict[object, int]] = {}
        for kind, module in pairs:
            kind_rows = rows.setdefault(kind, {})
            if module in kind_rows:
                raise ValueError(f"module {type(module).__name__} appears twice in the walk of kind {kind!r}")
            kind_rows[module] = len(kind_rows)
        self._rows = rows
        return self

    def _walked(self) -> dict[str, dict[object, int]]:
        if self._rows is None:
            raise RuntimeError("pool rows are not assigned: walk() the modules first")
        return self._rows

    def row(self, kind: str, module) -> int:
        rows = self._walked()
        if kind not in rows:
            raise KeyError(f"no pool kind {kind!r}; walked kinds: {sorted(rows)}")
        if module not in rows[kind]:
            raise KeyError(f"{type(module).__name__} at {id(module):#x} was never walked for kind {kind!r}")
        return rows[kind][module]

    def __getitem__(self, kind: str) -> "_KindRows":
        return _KindRows(self, kind)

    def row_counts(self) -> dict[str, int]:
        return {kind: len(rows) for kind, rows in self._walked().items()}

    def invalidate(self) -> None:
        self._rows = None


class _KindRows:
    def __init__(self, rows: PoolRows, kind: str):
        self._rows, self._kind = rows, kind

    def __getitem__(self, module) -> int:
        return self._rows.row(self._kind, module)
