"""The result of one ``lctrain eval`` run, as JSON (what ``--json FILE`` writes)::

    {"lctrain_eval": 1,                       # version of this contract
     "task": "ppl" | "passkey",
     "title": "...",
     "meta": {"target": ..., "step": ..., "seq_len": ..., "cp": ..., "dp": ..., "seconds": ...,
              "peak_memory_bytes": ..., "machine": {...}, "command": "lctrain eval ..."},
     "rows": [...]}

ppl rows: one per position bucket — ``bucket`` ("0–4K"), ``start``, ``stop`` (positions),
``tokens`` (target tokens scored), ``loss`` (mean, nats), ``ppl`` (exp of it) — then one
``bucket: "all"`` row over every position. passkey rows: one per (length, depth) —
``seq_len``, ``depth``, ``needle_position`` (token where the needle starts), ``placed_depth``,
``trials``, ``correct``, ``accuracy``, ``passkey`` and ``answer`` of the first trial, and
``samples`` (every trial's passkey, answer text, parsed number and verdict).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lctrain.errors import UserError
from lctrain.report.output import save_document

SCHEMA = 1
TASKS = ("ppl", "passkey")


@dataclass
class EvalResult:
    """Rows of one evaluation and the facts they were measured under."""

    task: str
    title: str
    rows: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def to_json(self, indent: int | None = 2) -> str:
        """The result as the JSON document described in the module docstring."""
        return json.dumps({"lctrain_eval": SCHEMA, "task": self.task, "title": self.title,
                           "meta": self.meta, "rows": self.rows}, indent=indent, default=str)

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` (creating its folder); returns the path."""
        return save_document(path, self.to_json())


def load(path: str | Path) -> EvalResult:
    """Read a result file.

    Raises:
        UserError: missing, not JSON, or not an evaluation result.
    """
    target = Path(path).expanduser()
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read {target}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{target} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("task") not in TASKS or \
            not isinstance(data.get("rows"), list):
        raise UserError(f"{target} is not an lctrain eval result (task ppl or passkey with rows)")
    return EvalResult(task=data["task"], title=str(data.get("title") or data["task"]),
                      rows=data["rows"], meta=dict(data.get("meta") or {}))
