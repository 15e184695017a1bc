"""The one result contract of every ``lctrain bench`` run, as JSON: ``{"lctrain_bench": 1,
"kind": "kernel" | "attention" | "step" | "data", "title", "meta": {"machine", "command", ...},
"rows"}``. Rows are flat: ``seq_len``, ``*_ms`` (medians), ``*_tflops`` (per GPU), ``status``
("ok" or why there is no number)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lctrain.errors import UserError
from lctrain.report.table import ResultDocument, read_document

KINDS = ("kernel", "attention", "step", "data")


@dataclass
class BenchResult(ResultDocument):
    """Rows of one benchmark run: ``kind`` (one of ``KINDS``), ``title``, ``rows`` (flat dicts
    of JSON values) and ``meta`` (machine, command, FLOP model, fixed parameters)."""

    MARK, KEY = "lctrain_bench", "kind"
    kind: str

    def measured(self) -> list[dict]:
        """The rows that carry a measurement (status "ok")."""
        return [row for row in self.rows if row.get("status") == "ok"]


def from_dict(data, source: str = "result") -> BenchResult:
    """A BenchResult from a parsed result file (``source`` names it in errors)."""
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise UserError(f"{source} is not an lctrain bench result (no list of rows); pass files "
                        "written by lctrain bench --json")
    kind = data.get("kind")
    if kind not in KINDS:
        raise UserError(f"{source} holds a result of unknown kind {kind!r}; lctrain bench "
                        f"writes {', '.join(KINDS)}")
    rows = [row for row in data["rows"] if isinstance(row, dict)]
    return BenchResult(kind=kind, title=str(data.get("title") or kind), rows=rows,
                       meta=dict(data.get("meta") or {}))


def load(path: str | Path) -> BenchResult:
    """Read a result file (UserError: missing, not JSON, or not a bench result)."""
    target, data = read_document(path, "; pass files written by lctrain bench --json")
    return from_dict(data, str(target))


def merge(results: list[BenchResult]) -> BenchResult:
    """One result from several runs of the same kind: meta entries equal in every part stay
    in meta, the others move into each row of their part (a row's own value wins)."""
    if not results:
        raise UserError("no results to merge; pass one or more result files")
    kinds = sorted({r.kind for r in results})
    if len(kinds) > 1:
        raise UserError(f"cannot merge results of different kinds ({', '.join(kinds)}); "
                        "merge files of one bench at a time")
    if len(results) == 1:
        return results[0]
    common = _common([r.meta for r in results])
    rows = []
    for part in results:
        extra = {k: v for k, v in part.meta.items() if k not in common
                 and not isinstance(v, (dict, list))}
        rows += [{**extra, **row} for row in part.rows]
    return BenchResult(kind=kinds[0], title=results[0].title, rows=rows, meta=common)


def _common(metas: list[dict]) -> dict:
    """The entries every dict shares; nested dicts (``machine``) keep their shared entries."""
    out = {}
    for key, value in metas[0].items():
        values = [m.get(key) for m in metas]
        if all(isinstance(v, dict) for v in values):
            out[key] = _common(values)
        elif all(key in m and m[key] == value for m in metas):
            out[key] = value
    return out
