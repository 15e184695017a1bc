"""Running an evaluation on every local rank: what ``lctrain eval`` calls.

    cfg, request = resolve("runs/tiny", task="ppl", cp=2)        # lctrain.eval.request
    result = evaluate(cfg, request)                               # an EvalResult

`evaluate` starts the ranks the way ``lctrain finetune`` does (`lctrain.launch.launcher.dispatch`:
this process alone, or ``python -m lctrain.eval`` on every local GPU / on cp gloo processes of
a CPU machine, or each rank of a torchrun job), each running `eval_worker`: the run's process
group, dp × cp mesh and `ContextParallel`; the model built by the training's own
`lctrain.train.runner.build_model` around an `lctrain.eval.model.EvalModel`, with the
``lctrain_eval`` attention (`lctrain.eval.decode`); a run's checkpoint loaded into it; then the
task (`lctrain.eval.tasks`). Rank 0 writes the result file, which this process reads back.
Launch files live in a temporary folder, removed unless a rank failed in a way that left
only its log (then named in the error).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import set_seed

from lctrain.config import RecipeConfig
from lctrain.errors import UserError
from lctrain.eval.decode import register_eval_attention
from lctrain.eval.model import EvalModel, load_weights
from lctrain.eval.request import EvalRequest
from lctrain.eval.result import EvalResult, load
from lctrain.eval.tasks import run_passkey, run_ppl
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.mesh import build_mesh
from lctrain.report.versions import environment
from lctrain.launch import launcher, rank
from lctrain.parallel.mesh import peak_memory_bytes
from lctrain.parallel.build import RunSetup, build_model

WORKER_MODULE = "lctrain.eval"
"""What each self-launched rank of an evaluation runs (``python -m lctrain.eval``)."""


def evaluate(cfg: RecipeConfig, request: EvalRequest, *, nproc: int | None = None
             ) -> EvalResult | None:
    """Run ``request`` on every rank ``cfg`` asks for; the result (None on ranks other than 0
    of a torchrun job, which render nothing).

    Args:
        cfg: the recipe from `lctrain.eval.request.resolve`.
        request: what to evaluate.
        nproc: processes (default: every GPU, or cp processes on a CPU).

    Raises:
        UserError: the ranks cannot start (layout, device), a rank failed with a user error,
            or a rank failed otherwise (the message names its log).
    """
    if request.task == "passkey":
        check_passkey_lengths(cfg, request)
    scratch = Path(tempfile.mkdtemp(prefix="lctrain-eval-"))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(scratch)))
    request = dataclasses.replace(request, result_file=str(scratch / "result.json"))
    (scratch / "request.json").write_text(request.to_json())
    worker = functools.partial(eval_worker, request=request)
    try:
        code = launcher.dispatch(cfg, worker, resume=False, nproc=nproc, module=WORKER_MODULE,
                               args=("--request", str(scratch / "request.json")))
    except UserError as error:  # a rank failed: its log outlives the scratch folder
        kept = launcher.keep_workers_log(scratch)
        shutil.rmtree(scratch, ignore_errors=True)
        if kept is None:
            raise
        raise UserError(f"{error}; the ranks' log is kept at {kept}") from None
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if code != 0:
        raise UserError(f"the evaluation failed (exit code {code}); its ranks' log is "
                        f"{scratch / '.launch' / 'workers.log'}")
    result_file = Path(request.result_file)
    result = load(result_file) if result_file.exists() else None
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def worker_entry(argv: list[str] | None = None) -> int:
    """``python -m lctrain.eval``: read ``--request FILE`` (an `EvalRequest`), then run
    `eval_worker` as `lctrain.launch.rank.worker_main` runs a training rank (``--config``,
    ``--error-dir``); returns the exit code."""
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}", add_help=False)
    parser.add_argument("--request", required=True, help="the EvalRequest as JSON")
    known, rest = parser.parse_known_args(argv)
    request = EvalRequest.from_json(Path(known.request).read_text())
    return rank.worker_main(functools.partial(eval_worker, request=request), rest)


def check_passkey_lengths(cfg: RecipeConfig, request: EvalRequest) -> None:
    """Refuse, before any rank starts, a passkey length too short for the prompt's fixed text.

    Raises:
        UserError: the shortest length cannot hold the introduction, needle and question.
    """
    from lctrain.model import load_tokenizer
    from lctrain.eval.passkey import passkey_prompt

    passkey_prompt(load_tokenizer(cfg), min(request.lengths), 0.0, "12345")


def eval_worker(cfg: RecipeConfig, *, resume: bool = False, request: EvalRequest) -> int:
    """This rank's part of an evaluation (every rank calls it); returns 0.

    Raises:
        UserError: the checkpoint does not fit the model, bad data, a length the layout
            cannot cut, ...
    """
    del resume  # an evaluation has nothing to resume
    with rank.worker_process(cfg) as accelerator:
        device = accelerator.device
        pmesh = build_mesh(cfg.parallel.cp, cfg.parallel.dp or None, device_type=device.type)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=pmesh.dp))
        cp = ContextParallel(pmesh, cfg.parallel.schedule, cfg.parallel.attention_backend,
                             device=device)
        cp.attention = register_eval_attention()  # "lctrain" + keys kept for decoding
        setup = RunSetup(cfg=cfg, pmesh=pmesh, cp=cp, accelerator=accelerator)
        set_seed(cfg.train.seed)
        start = time.perf_counter()
        parts = build_model(setup, EvalModel)
        if request.checkpoint is not None:
            load_weights(parts.distributed.module, request.checkpoint)
        parts.distributed.module.eval()
        load_s = time.perf_counter() - start
        task = run_ppl if request.task == "ppl" else run_passkey
        rows, meta = task(setup, parts, request)
        peak = _peak_over_ranks(pmesh, device)
        if setup.main:
            meta = {**_meta(setup, parts, request, load_s, peak), **meta}  # the task's peak wins
            result = EvalResult(task=request.task, title=_title(request, setup), rows=rows,
                                meta=meta)
            result.save(request.result_file)
    return 0


def _peak_over_ranks(pmesh, device: torch.device) -> int:
    peak = torch.tensor([float(peak_memory_bytes(device))], dtype=torch.float64, device=device)
    if pmesh.world_group is not None and pmesh.world_size > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=pmesh.world_group)
    return int(peak.item())


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


def _title(request: EvalRequest, setup: RunSetup) -> str:
    what = {"run": "run", "model": "model", "recipe": "recipe"}[request.kind]
    step = f" step {request.step}" if request.step is not None else ""
    where = f"{setup.pmesh.world_size} × {setup.pmesh.device_type} (cp {setup.pmesh.cp})"
    if request.task == "ppl":
        return f"Loss by position — {what} {request.target}{step}, {where}"
    return f"Passkey retrieval — {what} {request.target}{step}, {where}"
