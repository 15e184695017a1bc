"""Running an evaluation on every local rank: what ``lctrain eval`` calls.

The ranks build the model as training's do, around an `EvalModel` (the FSDP2 root, holding the LM
under the loss module's attribute name, so any run's DCP checkpoint loads), load the checkpoint
and run the task: `run_ppl` sums token losses per bucket of global positions; `run_passkey`
spreads the prompts over the dp groups, each prefilled over its cp group and decoded greedily.
Rank 0 writes the result file, which this process reads back."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from torch import nn

from lctrain.checkpoint.reader import load_model
from lctrain.config import RecipeConfig
from lctrain.data import eval_batches, prepare_data, rows_summary
from lctrain.errors import UserError
from lctrain.eval.decode import generate, register_eval_attention
from lctrain.eval.passkey import (answer_text, answer_tokens, passkey_cases, passkey_prompt,
                                  summarize)
from lctrain.eval.result import EvalResult, load
from lctrain.eval.request import EvalRequest
from lctrain.launch import launcher, rank
from lctrain.model import CPContext, load_tokenizer
from lctrain.model.structure import head_inputs
from lctrain.parallel.build import RunSetup, build_model
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.loss_sums import bucket_sums, forward_sums
from lctrain.parallel.mesh import build_mesh, peak_memory_bytes
from lctrain.report.human import tokens as token_text
from lctrain.report.versions import environment

WORKER_MODULE = "lctrain.eval"  # what each self-launched rank runs


class EvalModel(nn.Module):
    """decoder → final hidden states → per-position loss sums, or next-token logits;
    ``chunk_tokens`` bounds the logits held at once (``fused``, the loss's switch, is unused)."""

    def __init__(self, model: nn.Module, chunk_tokens: int, fused: bool = False) -> None:
        super().__init__()
        self.model, self.chunk_tokens = model, chunk_tokens

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                cp_context: CPContext | None = None, labels: torch.Tensor | None = None,
                width: int = 1, buckets: int = 1, kv=None, at: int | None = None
                ) -> torch.Tensor:
        """With ``labels``: (2, buckets) float64 loss sums and counts per position bucket of this
        rank's (B, S_local) shard; else the (B, V) float32 logits after global position ``at``
        (zeros on a rank without it). ``kv``: a `KVShards` keeping or using keys."""
        extra = {} if kv is None else {"lctrain_kv": kv}
        hidden, weight = head_inputs(self.model, input_ids=input_ids, position_ids=position_ids,
                                     cp_context=cp_context, **extra)  # (B, S_local, H), (V, H)
        if labels is not None:
            return bucket_sums(hidden, weight, labels, position_ids, width=width,
                               buckets=buckets, chunk_tokens=self.chunk_tokens)
        here = position_ids == at  # (B, S_local)
        index = here.int().argmax(dim=1)  # (B,) where it is (0 when it is not here)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = hidden[rows, index] * here.any(dim=1, keepdim=True).to(hidden.dtype)  # (B, H)/zeros
        return (last @ weight.T).float()  # (B, V)


def evaluate(cfg: RecipeConfig, request: EvalRequest, *, nproc: int | None = None
             ) -> EvalResult | None:
    """Run ``request`` on every rank ``cfg`` asks for (``nproc``: default every GPU, or cp
    processes on a CPU); the result, None on ranks other than 0 of a torchrun job. UserError
    when the ranks cannot start or one failed (the message names its log)."""
    if request.task == "passkey":  # a length too short for the fixed text, before any rank
        passkey_prompt(load_tokenizer(cfg), min(request.lengths), 0.0, "12345")
    scratch = Path(tempfile.mkdtemp(prefix="lctrain-eval-"))
    code = 0
    try:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                 output_dir=str(scratch)))
        if request.kind == "adapter":  # the base model with the adapter merged in, once
            from lctrain.model.lora import merge_adapter

            folder = merge_adapter(request.target, cfg.model.path, scratch / "model",
                                   trust_remote_code=cfg.model.trust_remote_code)
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(folder)))
        request = dataclasses.replace(request, result_file=str(scratch / "result.json"))
        (scratch / "request.json").write_text(request.to_json())
        worker = functools.partial(eval_worker, request=request)
        try:
            code = launcher.dispatch(cfg, worker, resume=False, nproc=nproc, module=WORKER_MODULE,
                                     args=("--request", str(scratch / "request.json")))
        except UserError as error:  # a rank failed: its log outlives the scratch folder
            kept = launcher.keep_workers_log(scratch)
            if kept is None:
                raise
            raise UserError(f"{str(error).rstrip('.')}; the ranks' log is kept at {kept}") from None
        if code != 0:
            raise UserError(f"the evaluation failed (exit code {code}); its ranks' log is "
                            f"{scratch / '.launch' / 'workers.log'}")
        result_file = Path(request.result_file)
        return load(result_file) if result_file.exists() else None
    finally:
        if code == 0:  # a failed run's scratch folder holds the log its message names
            shutil.rmtree(scratch, ignore_errors=True)


def worker_entry(argv: list[str] | None = None) -> int:
    """``python -m lctrain.eval --request FILE``: `eval_worker` run as a training rank; the exit
    code."""
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}", add_help=False)
    parser.add_argument("--request", required=True, help="the EvalRequest as JSON")
    known, rest = parser.parse_known_args(argv)
    request = EvalRequest.from_json(Path(known.request).read_text())
    return rank.worker_main(functools.partial(eval_worker, request=request), rest)


def eval_worker(cfg: RecipeConfig, *, resume: bool = False, request: EvalRequest) -> int:
    """This rank's part of an evaluation; returns 0."""
    del resume  # an evaluation has nothing to resume
    with rank.worker_process(cfg) as accelerator:
        device = accelerator.device
        pmesh = build_mesh(cfg.parallel.cp, device_type=device.type)
        cp = ContextParallel(pmesh, cfg.parallel.schedule, cfg.parallel.attention_backend,
                             device=device)
        cp.attention = register_eval_attention()  # "lctrain" + keys kept for decoding
        setup = RunSetup(cfg=cfg, pmesh=pmesh, cp=cp, accelerator=accelerator)
        set_seed(cfg.train.seed)
        start = time.perf_counter()
        parts = build_model(setup, EvalModel)
        if request.checkpoint is not None:
            load_model(request.checkpoint, parts.distributed.module)
        parts.distributed.module.eval()
        load_s = time.perf_counter() - start
        task = run_ppl if request.task == "ppl" else run_passkey
        # progress lines from rank 0 on stdout when it is a terminal
        say = functools.partial(print, flush=True) if setup.main and sys.stdout.isatty() else (
            lambda line: None)
        rows, meta = task(setup, parts, request, load_tokenizer(cfg), say)
        peak = torch.tensor([float(peak_memory_bytes(device))], dtype=torch.float64, device=device)
        if pmesh.world_group is not None and pmesh.world_size > 1:  # the largest of any rank
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=pmesh.world_group)
        peak = int(peak.item())  # every rank waits for the reduction
        if setup.main:
            meta = {**_meta(setup, parts, request, load_s, peak), **meta}  # the task's peak wins
            name = "Loss by position" if request.task == "ppl" else "Passkey retrieval"
            step = f" step {request.step}" if request.step is not None else ""
            title = (f"{name} — {request.kind} {request.target}{step}, "
                     f"{pmesh.world_size} × {pmesh.device_type} (cp {pmesh.cp})")
            result = EvalResult(task=request.task, title=title, rows=rows, meta=meta)
            result.save(request.result_file)
    return 0


def _meta(setup: RunSetup, parts, request: EvalRequest, load_s: float, peak: int) -> dict:
    cfg, pmesh = setup.cfg, setup.pmesh
    return {"target": request.target, "kind": request.kind, "step": request.step,
            "checkpoint": request.checkpoint, "seq_len": cfg.data.seq_len,
            "parameters": parts.n_params, "cp": pmesh.cp, "dp": pmesh.dp,
            "device": pmesh.device_type, "schedule": cfg.parallel.schedule,
            "attention_backend": cfg.parallel.attention_backend,
            "strategy": parts.distributed.strategy, "model_dtype": cfg.model.dtype,
            "mixed_precision": setup.accelerator.mixed_precision, "load_seconds": load_s,
            "peak_memory_bytes": peak, "machine": environment()}


def run_ppl(setup, parts, request, tokenizer, say) -> tuple[list[dict], dict]:
    """Loss and perplexity per position bucket over the request's rows (``say``: progress)."""
    cfg, pmesh, cp = setup.cfg, setup.pmesh, setup.cp
    local_rank = int(os.environ.get("LOCAL_RANK", pmesh.rank))
    rows = prepare_data(cfg.data, tokenizer, leader=local_rank == 0,
                        show_progress=setup.main and sys.stdout.isatty(), part=request.part,
                        seed=cfg.train.seed)
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
        out.append(_ppl_row(f"{token_text(lo)}–{token_text(hi)}", lo, hi, sums[0][b], sums[1][b]))
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
    return {"bucket": name, "start": lo, "stop": hi, "tokens": int(count), "loss": loss, "ppl": ppl}


def _counted(batches: Iterator, say: Callable[[str], None], rows: int, per_batch: int) -> Iterator:
    """``batches``, saying how many rows of all dp ranks are done after each."""
    for index, batch in enumerate(batches, 1):
        yield batch
        say(f"ppl: {min(index * per_batch, rows):,} of {rows:,} rows")


def run_passkey(setup, parts, request, tokenizer, say) -> tuple[list[dict], dict]:
    """The passkey test over the request's lengths × depths × trials (``say``: progress)."""
    pmesh = setup.pmesh
    cases = passkey_cases(list(request.lengths), list(request.depths), request.trials, request.seed)
    steps = max(answer_tokens(tokenizer, case.passkey) for case in cases)
    slots = -(-len(cases) // pmesh.dp)  # every dp group runs as many prompts (in step)
    start = _start_clock(setup)
    outcomes: dict[int, dict] = {}
    for index in range(pmesh.dp_rank, slots * pmesh.dp, pmesh.dp):
        case = cases[index if index < len(cases) else 0]  # past the last case: run, not kept
        prompt = passkey_prompt(tokenizer, case.length, case.depth, case.passkey)
        began = time.perf_counter()
        if setup.accelerator.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.accelerator.device)
        ids, _ = generate(parts.distributed.module, prompt.ids, steps, cp=setup.cp,
                          accelerator=setup.accelerator, vocab=len(tokenizer))
        if index >= len(cases):
            continue
        outcomes[index] = {"answer": answer_text(tokenizer, ids),
                           "needle_start": prompt.needle_start, "placed_depth": prompt.placed_depth,
                           "seconds": time.perf_counter() - began,
                           "peak_memory_bytes": peak_memory_bytes(setup.accelerator.device)}
        say(f"passkey {token_text(case.length)} at depth {case.depth:g}: expected "
            f"{case.passkey}, got {outcomes[index]['answer'].strip()!r}")
    merged = _gather(outcomes, pmesh)
    rows = summarize(cases, [merged[i] for i in range(len(cases))])
    for row in rows:
        mine = [merged[i] for i, c in enumerate(cases)
                if (c.length, c.depth) == (row["seq_len"], row["depth"])]
        row["seconds"] = sum(o["seconds"] for o in mine) / len(mine)
        row["peak_memory_bytes"] = max(o["peak_memory_bytes"] for o in mine)
    meta = {"cases": len(cases), "generated_tokens": steps, "seconds": time.perf_counter() - start,
            "peak_memory_bytes": max(row["peak_memory_bytes"] for row in rows)}
    return rows, meta


def _gather(outcomes: dict[int, dict], pmesh) -> dict[int, dict]:
    """Every rank's outcomes, a case's peak memory the largest of its cp ranks'."""
    if pmesh.world_group is None or pmesh.world_size == 1:
        return outcomes
    everyone: list = [None] * pmesh.world_size
    dist.all_gather_object(everyone, outcomes, group=pmesh.world_group)
    merged: dict[int, dict] = {}
    for part in everyone:
        for index, outcome in part.items():
            first = merged.get(index, outcome)
            peak = max(first["peak_memory_bytes"], outcome["peak_memory_bytes"])
            merged[index] = {**first, "peak_memory_bytes": peak}
    return merged


def _start_clock(setup) -> float:
    """Start timing the task (and, on a GPU, its peak memory)."""
    if setup.accelerator.device.type == "cuda":
        torch.cuda.synchronize(setup.accelerator.device)
        torch.cuda.reset_peak_memory_stats(setup.accelerator.device)
    return time.perf_counter()
