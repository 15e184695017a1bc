"""The two evaluation tasks, as every rank runs them once the model is built.

- `run_ppl`: loss and perplexity by position. The rows (the run's validation data, or any
  source) are cut along the sequence as in training; each rank adds up the token losses of the
  tokens it holds per position bucket — a token's position is its GLOBAL position id, carried
  through the cut, so a zigzag or contiguous layout puts every token in its bucket — and one
  all-reduce of (2 × buckets) numbers gives the totals. No rank ever holds the logits of more
  than ``train.loss_chunk_tokens`` tokens.
- `run_passkey`: the passkey prompts (`lctrain.eval.passkey`) spread over the dp groups, each
  prefilled over its cp group and decoded greedily (`lctrain.eval.decode.generate`); the
  answers are gathered on rank 0.

Both return result rows and the facts to put in the result's meta (time, peak memory).
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from lctrain.data import eval_batches, prepare_data, rows_summary
from lctrain.model import load_tokenizer
from lctrain.eval.decode import generate
from lctrain.parallel.forward import forward_sums
from lctrain.eval.passkey import (answer_tokens, decode_text, passkey_cases, passkey_prompt,
                                  summarize)
from lctrain.report.human import tokens as token_text
from lctrain.parallel.mesh import peak_memory_bytes


def progress_printer(main: bool) -> Callable[[str], None]:
    """Progress lines from rank 0 on stdout when it is a terminal (a piped result stays clean)."""
    if not (main and sys.stdout.isatty()):
        return lambda line: None
    return lambda line: print(line, flush=True)


def run_ppl(setup, parts, request) -> tuple[list[dict], dict]:
    """Loss and perplexity per position bucket over the request's rows (every rank).

    Returns:
        (result rows, meta: rows, tokens, seconds, tokens/s).
    """
    cfg, pmesh, cp = setup.cfg, setup.pmesh, setup.cp
    say = progress_printer(setup.main)
    tokenizer = load_tokenizer(cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", pmesh.rank))
    rows = prepare_data(cfg.data, tokenizer, leader=local_rank == 0,
                        show_progress=setup.main and sys.stdout.isatty(), part=request.part)
    for line in rows_summary(rows):
        say(line)
    seq_len, width = cfg.data.seq_len, request.bucket
    buckets = math.ceil(seq_len / width)
    count = len(rows) if request.max_rows is None else min(request.max_rows, len(rows))
    module = parts.distributed.module

    def call(shard):
        return module(shard.input_ids, shard.position_ids, cp_context=cp.context(shard),
                      labels=shard.labels, width=width, buckets=buckets)

    batches = eval_batches(rows, batch_size=cfg.train.batch_size, dp_rank=pmesh.dp_rank,
                           dp_size=pmesh.dp, limit=count)
    start = _start_clock(setup)
    sums = forward_sums(call, _counted(batches, say, count, pmesh.dp * cfg.train.batch_size),
                        cp=cp, pmesh=pmesh, accelerator=setup.accelerator,
                        shape=(2, buckets)).tolist()
    seconds = time.perf_counter() - start
    out = []
    for b in range(buckets):
        lo, hi = b * width, min((b + 1) * width, seq_len)
        name = f"{token_text(lo)}–{token_text(hi)}"
        out.append(_ppl_row(name, lo, hi, sums[0][b], sums[1][b]))
    out.append(_ppl_row("all", 0, seq_len, sum(sums[0]), sum(sums[1])))
    meta = {"rows": count, "rows_available": len(rows), "data_source": rows.info["source"],
            "data_part": request.part, "bucket": width, "seconds": seconds,
            "document_mask": cfg.data.document_mask,
            "tokens_per_s": count * seq_len / seconds if seconds > 0 else None,
            "seconds_per_row": seconds * pmesh.dp / count}
    return out, meta


def _ppl_row(name: str, lo: int, hi: int, loss_sum: float, count: float) -> dict:
    loss = loss_sum / count if count else None
    ppl = math.exp(loss) if loss is not None and loss < 700 else None
    return {"bucket": name, "start": lo, "stop": hi, "tokens": int(count), "loss": loss,
            "ppl": ppl}


def _counted(batches: Iterator, say: Callable[[str], None], rows: int,
             per_batch: int) -> Iterator:
    """``batches``, saying how many rows of all dp ranks are done after each."""
    for index, batch in enumerate(batches, 1):
        yield batch
        say(f"ppl: {min(index * per_batch, rows):,} of {rows:,} rows")


def run_passkey(setup, parts, request) -> tuple[list[dict], dict]:
    """The passkey test over the request's lengths × depths × trials (every rank).

    Returns:
        (result rows, meta: cases, tokens generated per case, seconds).
    """
    cfg, pmesh = setup.cfg, setup.pmesh
    say = progress_printer(setup.main)
    tokenizer = load_tokenizer(cfg)
    cases = passkey_cases(list(request.lengths), list(request.depths), request.trials,
                          request.seed)
    steps = max(answer_tokens(tokenizer, case.passkey) for case in cases)
    mine = list(range(pmesh.dp_rank, len(cases), pmesh.dp))
    slots = -(-len(cases) // pmesh.dp)  # every dp group runs as many prompts (in step)
    start = _start_clock(setup)
    outcomes: dict[int, dict] = {}
    for slot in range(slots):
        index = mine[slot] if slot < len(mine) else None
        case = cases[0 if index is None else index]
        prompt = passkey_prompt(tokenizer, case.length, case.depth, case.passkey)
        began = time.perf_counter()
        if setup.accelerator.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.accelerator.device)
        ids, _ = generate(parts.distributed.module, prompt.ids, steps, cp=setup.cp,
                          accelerator=setup.accelerator, vocab=len(tokenizer))
        if index is None:
            continue
        outcomes[index] = {"answer": decode_text(tokenizer, ids),
                           "needle_start": prompt.needle_start,
                           "placed_depth": prompt.placed_depth,
                           "seconds": time.perf_counter() - began,
                           "peak_memory_bytes": peak_memory_bytes(setup.accelerator.device)}
        say(f"passkey {token_text(case.length)} at depth {case.depth:g}: expected "
            f"{case.passkey}, got {outcomes[index]['answer'].strip()!r}")
    merged = _gather(outcomes, pmesh)
    rows = summarize(cases, [merged[i] for i in range(len(cases))])
    for row in rows:
        mine_cases = [merged[i] for i, c in enumerate(cases)
                      if (c.length, c.depth) == (row["seq_len"], row["depth"])]
        row["seconds"] = sum(o["seconds"] for o in mine_cases) / len(mine_cases)
        row["peak_memory_bytes"] = max(o["peak_memory_bytes"] for o in mine_cases)
    meta = {"cases": len(cases), "generated_tokens": steps,
            "seconds": time.perf_counter() - start,
            "peak_memory_bytes": max(row["peak_memory_bytes"] for row in rows)}
    return rows, meta


def _gather(outcomes: dict[int, dict], pmesh) -> dict[int, dict]:
    """Every rank's outcomes; the cp ranks of a dp group agree on the answer, and the peak
    memory of a case is the largest of theirs."""
    if pmesh.world_group is None or pmesh.world_size == 1:
        return outcomes
    everyone: list = [None] * pmesh.world_size
    dist.all_gather_object(everyone, outcomes, group=pmesh.world_group)
    merged: dict[int, dict] = {}
    for part in everyone:
        for index, outcome in part.items():
            if index in merged:
                outcome = {**merged[index], "peak_memory_bytes": max(
                    merged[index]["peak_memory_bytes"], outcome["peak_memory_bytes"])}
            merged[index] = outcome
    return merged


def _start_clock(setup) -> float:
    """Start timing the task (after the model is built); on a GPU, the peak memory too."""
    if setup.accelerator.device.type == "cuda":
        torch.cuda.synchronize(setup.accelerator.device)
        torch.cuda.reset_peak_memory_stats(setup.accelerator.device)
    return time.perf_counter()
