"""How each kind of bench result is shown: its columns, its title, its summary table.

`table` has one row per measurement in columns that fit 80 characters (``--wide`` adds the rest);
`summary` pivots them as the docs show them (lengths down, variants across). Document mixes are
spelled in the notes. Nothing here imports torch."""
from __future__ import annotations

from dataclasses import replace

from lctrain.bench.result import BenchResult
from lctrain.report.human import milliseconds, percent, rate, ratio, significant, tokens
from lctrain.report.table import Column, Table
from lctrain.report.versions import machine_label


def _wide(key: str, label: str, kind: str = "text", unit: str = "") -> Column:
    """A column shown only with ``--wide``."""
    return Column(key, label, kind, unit, compact=False)


_STATUS = Column("status", "status", "status")
_RATES = [Column("fwd_tflops", "fwd", "tflops"), Column("bwd_tflops", "bwd", "tflops"),
          Column("total_tflops", "fwd+bwd", "tflops")]
_TIMES = [_wide("fwd_ms", "fwd", "ms"), _wide("bwd_ms", "bwd", "ms"),
          _wide("total_ms_min", "fwd+bwd min", "ms"), _wide("total_ms_max", "fwd+bwd max", "ms"),
          _wide("repeats", "repeats", "number")]
_PROFILE = [Column(f"profile_{cat}_ms", label, "ms") for cat, label in (
    ("wall", "wall"), ("attention", "attention"), ("communication", "comm."),
    ("bookkeeping", "bookkeeping"), ("other", "other"))]
_STEP_PROFILE = [_wide(f"profile_{cat}_ms", label, "ms") for cat, label in (
    ("wall", "profiled"), ("attention", "attention"), ("matmul", "matmul"),
    ("communication", "comm."), ("copies", "copies"), ("other", "other"))]

COLUMNS = {
    "kernel": [Column("backend", "backend"), Column("seq_len", "length", "tokens"), *_RATES,
               Column("of_dense", "of dense", "percent"), Column("max_rel_err", "error", "sci"),
               _STATUS, _wide("of_dense_fwd", "fwd of dense", "percent"),
               _wide("of_dense_bwd", "bwd of dense", "percent"), _wide("relation", "mask"),
               *_TIMES, _wide("correct", "correct", "bool"), *_PROFILE],
    "attention": [Column("variant", "variant"), Column("seq_len", "length", "tokens"), *_RATES,
                  Column("vs_single", "vs 1 GPU", "ratio"), Column("balance", "balance", "number"),
                  _STATUS, _wide("gpus", "GPUs", "number"),
                  _wide("hidden_share", "hidden", "percent"), *_TIMES,
                  _wide("comm_only_ms", "comm. only", "ms"), _wide("max_rel_err", "error", "sci"),
                  _wide("correct", "correct", "bool"), *_PROFILE],
    "step": [Column("seq_len", "length", "tokens"), Column("label", "variant"),
             Column("step_time_s", "step", "seconds"), Column("tokens_per_s", "tokens/s", "number"),
             Column("mfu", "MFU", "percent"), Column("sm_clock_ghz", "SM", "number", "GHz"),
             Column("peak_gib", "peak", "number", "GiB"),
             Column("model_peak_gib", "est.", "number", "GiB"),
             Column("host_gib", "host", "number", "GiB"),
             Column("model_host_gib", "est. host", "number", "GiB"), _STATUS,
             _wide("power_w", "power", "number", "W"), _wide("power_limit_w", "of", "number", "W"),
             _wide("model_step_s", "est. step", "seconds"),
             _wide("gpus", "GPUs", "number"), _wide("cp", "cp", "number"),
             _wide("schedule", "schedule"), _wide("policy", "checkpointing"),
             _wide("attn_fwd_per_step", "attn fwd", "number", "per step"),
             _wide("attn_fwd_expected", "expected", "number"),
             _wide("loss_first", "loss first", "loss"), _wide("loss_last", "loss last", "loss"),
             _wide("save_every", "save every", "number"),
             _wide("checkpoint_s", "save wait", "seconds"),
             _wide("step_after_save_s", "step after save", "seconds"),
             _wide("step_without_save_s", "step without", "seconds"),
             _wide("attention_balance", "balance", "number"), *_STEP_PROFILE],
    "data": [Column("source", "source"), Column("megabytes", "MiB", "number"),
             Column("records", "records", "number"), Column("tokens", "tokens", "number"),
             Column("processes", "processes", "number"), Column("cold_s", "cold", "seconds"),
             Column("warm_s", "warm", "seconds"), Column("tokens_per_s", "tokens/s", "number"),
             Column("megabytes_per_s", "MiB/s", "number"), _STATUS],
}


WHAT = {"kernel": "Attention kernels, one device, {rate}",
         "attention": "Distributed attention, {rate} per GPU",
         "step": "Training steps", "data": "Data preparation"}


def describe(result: BenchResult) -> str:
    """The machine and shape of a result in words, e.g. "2 × H200, bfloat16, 32 heads × 128"."""
    meta = result.meta
    parts = [machine_label(meta.get("machine") or {})]
    if meta.get("cores"):
        parts.append(f"{meta['cores']} cores")
    if meta.get("dtype"):
        parts.append(str(meta["dtype"]))
    if meta.get("heads") and meta.get("head_dim"):
        kv = meta.get("kv_heads")
        gqa = f" ({kv} kv)" if kv and kv != meta["heads"] else ""
        parts.append(f"{meta['heads']} heads{gqa} × {meta['head_dim']}")
    if meta.get("causal", True) is not None and result.kind in ("kernel", "attention"):
        parts.append("causal" if meta.get("causal", True) else "full")
    docs = meta.get("documents")  # specs (kernel) or one spec
    specs = [str(d) for d in docs] if isinstance(docs, list) else [str(docs)] if docs else []
    if len(specs) > 1:
        parts.append(f"{len(specs)} document mixes")
    elif specs:
        parts.append(f"{specs[0]} documents" if specs[0].isdigit() else f"documents {specs[0]}")
    if result.kind == "step" and meta.get("model_dtype"):
        compute = "bf16" if meta.get("mixed_precision") in ("bf16", "auto") else meta["model_dtype"]
        parts.append(f"{meta['model_dtype']} weights, {compute} compute")
    return ", ".join(parts)


def table(result: BenchResult) -> Table:
    """The result's rows in its kind's columns."""
    notes = _document_notes(result)
    if result.kind == "attention":
        notes.append("length = total sequence; each GPU holds length / GPUs tokens; "
                     "vs 1 GPU = rate over the single-GPU kernel's at the same length")
    columns, rows = list(COLUMNS[result.kind]), result.rows
    if result.kind == "step":
        # variants by their last key parts, with the layers an auto run placed; without
        # variants, schedule and checkpointing are compact columns where the rows differ
        rows = [{**row, "label": _label(row)} for row in rows]
        labelled = any(row["label"] for row in rows)
        columns = [replace(c, compact=not labelled and len({row.get(c.key) for row in rows}) > 1)
                   if c.key in ("schedule", "policy") else c for c in columns]
        if not (result.meta.get("machine") or {}).get("gpu"):
            notes.append("on a CPU, peak is the process's largest resident memory (Python, "
                         "torch and the libraries included); est. counts the training tensors")
    specs = _specs(result)
    if len(specs) > 1:  # rows of several mixes: number them (the notes say which is which)
        rows = [{**row, "mix_no": specs.index(row["documents"]) + 1
                 if row.get("documents") is not None else None} for row in rows]
        columns.insert(2, Column("mix_no", "mix", "number"))
    return Table(title=f"{WHAT[result.kind]} — {describe(result)}", columns=columns, rows=rows,
                 notes=notes)


def _specs(result: BenchResult) -> list[str]:
    return list(dict.fromkeys(row["documents"] for row in result.rows
                              if row.get("documents") is not None))


def _document_notes(result: BenchResult) -> list[str]:
    """The documents of each spec and length, and what "of dense" means."""
    specs, mixes = _specs(result), {}
    for row in result.rows:
        if row.get("documents") is not None and row.get("seq_len") is not None:
            mixes.setdefault((specs.index(row["documents"]), row["seq_len"]), row.get("mix"))
    notes = [f"{f'mix {k + 1}: ' if len(specs) > 1 else ''}documents {specs[k]} at "
             f"{tokens(length)}: {mix}" for (k, length), mix in sorted(mixes.items())]
    if mixes:
        notes.append("rates count useful FLOPs only (the pairs inside documents)")
    if mixes and result.kind == "attention":
        order = " in the order that evens it out" if result.meta.get("balance_documents") else ""
        notes.append(f"balance = the busiest GPU's attention work over the mean, for these "
                     f"documents{order}")
    if any(row.get("of_dense") for row in result.rows):
        reference = result.meta.get("dense_reference") or "the dense reference"
        notes.append(f"of dense (%) = useful rate over {reference}'s rate on one dense "
                     f"sequence of the same length")
    return notes


def short_variant(text: str | None) -> str:
    """A variant's overrides by their last key part: "train.checkpointing=remat parallel.cp=4"
    -> "checkpointing=remat cp=4"."""
    items = []
    for item in str(text or "").split():
        key, eq, value = item.partition("=")
        items.append(key.rsplit(".", 1)[-1] + eq + value)
    return " ".join(items)


def _label(row: dict) -> str | None:
    label = short_variant(row.get("variant"))
    placed = row.get("layer_policies") or (row.get("checkpointing")  # older rows: the former
                                            if row.get("policy") == "auto" else None)
    if label and placed and "layer_policies=" not in label:
        label += f" ({placed})"
    return label or None


def summary(result: BenchResult) -> Table:
    """The docs' form: lengths (and document mixes) down, variants or backends across,
    fwd+bwd TFLOP/s with the ratio to one GPU or the share of the dense rate; step results
    and data preparation keep their compact table."""
    if result.kind in ("step", "data"):
        whole = table(result)
        if all(row.get("status") == "ok" for row in result.rows):  # nothing to say per row
            whole.columns = [c for c in whole.columns if c.key != "status"]
        return whole
    series = "variant" if result.kind == "attention" else "backend"
    measured = {row.get(series) for row in result.measured()}
    names = [n for n in dict.fromkeys(row.get(series) for row in result.rows) if n in measured]
    lengths = sorted({row["seq_len"] for row in result.rows if "seq_len" in row})
    cells = {(row.get(series), row.get("seq_len"), row.get("documents")): row
             for row in result.rows}
    specs, rows = _specs(result), []
    for length in lengths:
        for spec in specs or [None]:
            if spec is not None and not any((n, length, spec) in cells for n in names):
                continue
            line = {"seq_len": length, "documents": spec}
            for name in names:
                line[name] = _summary_cell(cells.get((name, length, spec))
                                           or cells.get((name, length, None)))
            rows.append(line)
    columns = [Column("seq_len", "length", "tokens")]
    columns += [Column("documents", "documents")] if specs else []
    columns += [Column(n, n, "figure") for n in names]
    what = WHAT[result.kind].split(",")[0]
    unit = "fwd+bwd TFLOP/s" + (" per GPU" if result.kind == "attention" else "")
    return Table(title=f"{what}, {unit} — {describe(result)}", columns=columns, rows=rows,
                 notes=_summary_notes(result, names, series))


def progress_line(row: dict) -> str:
    """One line on a kernel (``backend``) or attention (``variant``) row as it is measured."""
    spec = f" {row['documents']}" if row.get("documents") and "backend" in row else ""
    head = f"{row.get('backend') or row['variant']}{spec} {tokens(row['seq_len'])}:"
    if row.get("status") != "ok":
        return f"{head} {row.get('status')}"
    per_gpu = "" if "backend" in row else " per GPU"
    text = (f"{head} fwd {milliseconds(row['fwd_ms'])}, bwd {milliseconds(row['bwd_ms'])}, "
            f"{rate(row['total_tflops'])}{per_gpu} fwd+bwd")
    if row.get("of_dense"):
        text += f", {percent(row['of_dense'])} of dense"
    return text + (f", {ratio(row['vs_single'])} one GPU" if row.get("vs_single") else "")


def _summary_cell(row: dict | None) -> str | None:
    if row is None:
        return None
    if row.get("status") != "ok" or row.get("total_tflops") is None:
        return "—"
    text = significant(row["total_tflops"])
    if row.get("of_dense"):
        return f"{text} ({100 * row['of_dense']:.0f}%)"
    return f"{text} ({ratio(row['vs_single'])})" if row.get("vs_single") else text


def _summary_notes(result: BenchResult, names: list[str], series: str) -> list[str]:
    notes, balance = _document_notes(result), []
    for name in dict.fromkeys(row.get(series) for row in result.rows):
        rows = [r for r in result.rows if r.get(series) == name]
        errors = [r["max_rel_err"] for r in rows if r.get("max_rel_err") is not None]
        if errors:
            notes.append(f"{name}: largest error against float32 math {max(errors):.1e}")
        balances = {r["balance"] for r in rows if r.get("balance") is not None}
        if balances:
            balance.append(f"{name} {'/'.join(f'{b:.2f}' for b in sorted(balances))}")
        for status in sorted({r["status"] for r in rows if r.get("status") not in (None, "ok")}):
            where = "" if name in names else " (column left out)"
            notes.append(f"{name}{where}: {status}")
    if balance:
        notes.append("balance (max/mean causal work per GPU): " + ", ".join(balance))
    if any(r.get("vs_single") for r in result.rows):
        notes.append("(×) = rate over the one-GPU kernel's at the same total length")
    return notes
