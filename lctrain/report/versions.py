"""What a number was measured with: package versions, CUDA, driver and GPUs — printed by
``lctrain --version``, kept in every bench result and in every run's environment.json."""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

_PACKAGES = ("lctrain", "torch", "triton", "transformers", "accelerate", "datasets",
             "liger-kernel", "nvidia-cudnn-frontend", "flash-attn-4", "nvidia-cutlass-dsl")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        if package == "lctrain":  # run from a source tree that was never installed
            import lctrain

            return lctrain.__version__
        return None


def _driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi, or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def environment() -> dict:
    """Versions of the packages (None when not installed), python, CUDA, cuDNN, driver (None
    without a GPU), the GPUs and the date."""
    import torch

    from lctrain_kernels.api import dotted_version

    cuda = torch.cuda.is_available()
    cudnn = torch.backends.cudnn.version() if cuda and torch.backends.cudnn.is_available() else None
    return {**{name: _version(name) for name in _PACKAGES}, "lctrain_commit": _commit(),
            "torch": torch.__version__,  # the build tag (+cu130, +cpu) matters
            "python": platform.python_version(), "cuda": torch.version.cuda if cuda else None,
            "cudnn": None if cudnn is None else dotted_version(cudnn),
            "driver": _driver() if cuda else None, "gpus": torch.cuda.device_count() if cuda else 0,
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}


def _commit() -> str | None:
    """The commit of the lctrain checkout that runs ("+changes" when its files differ from it),
    or ``LCTRAIN_COMMIT`` where set: code copied to another machine without its git folder, or
    with a stale one; None else."""
    if os.environ.get("LCTRAIN_COMMIT"):
        return os.environ["LCTRAIN_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        run = functools.partial(subprocess.run, cwd=root, capture_output=True, text=True,
                                timeout=10, check=True)
        commit = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no", "--", "lctrain",
                     "kernels"]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+changes" if dirty else "") if commit else None


def machine_label(info: dict) -> str:
    """A short name of the machine: "2 × NVIDIA H200", or "CPU"."""
    if not info.get("gpu"):
        return "CPU"
    count = info.get("gpus") or 1
    return f"{count} × {info['gpu']}" if count > 1 else str(info["gpu"])


def _gpus(info: dict) -> str:
    """The CUDA, cuDNN and driver versions and the GPUs of ``environment()``, in one line."""
    cudnn = f", cuDNN {info['cudnn']}" if info.get("cudnn") else ""
    return (f"CUDA {info.get('cuda')}{cudnn}, driver {info.get('driver') or 'unknown'}, "
            f"{machine_label(info)}")


def describe(info: dict) -> str:
    """``environment()`` as the lines ``lctrain --version`` prints."""
    return "\n".join([f"lctrain {info.get('lctrain') or 'unknown'}",
                      *(f"{name} {info.get(name) or 'not installed'}"
                        for name in ("torch", "triton", "transformers", "accelerate", "datasets")),
                      f"python {info.get('python')}",
                      _gpus(info) if info.get("gpu") else "CUDA: no GPU visible"])


def _ready(name: str) -> bool:
    """Whether the attention backend ``name`` loads and can run on this process's GPU."""
    import torch

    from lctrain_kernels.api import BackendUnavailable, get_backend
    try:
        backend = get_backend(name)
    except BackendUnavailable:
        return False
    return backend.setup_reason(torch.device("cuda", torch.cuda.current_device())) is None


def one_time_costs(device_type: str, attention_backend: str,
                   document_mask: bool = False) -> list[str]:
    """What the first training steps spend once, as sentences to print before it happens."""
    if device_type != "cuda":
        return []
    costs = []
    auto = attention_backend == "auto"
    cute = attention_backend == "flash_attn_cute" or (auto and _ready("flash_attn_cute"))
    ragged = document_mask and (attention_backend == "cudnn_ragged"
                                or (auto and not cute and _ready("cudnn_ragged")))
    if attention_backend == "triton" or (auto and document_mask and not (ragged or cute)):
        costs.append("autotuning attention kernels for this shape — first step only")
    if cute:
        costs.append("compiling FlashAttention 4's kernels for these shapes — the first steps; "
                     "later runs on this machine load them from its cache")
    if ragged:
        costs.append("cuDNN plans for document-masked attention — the first steps, once per "
                     "count and longest length of documents (each rounded up to a power of two)")
    costs.append("NCCL and cuDNN set-up — first step only")
    return costs


def record_run(output_dir: str | Path, device_type: str, attention_backend: str,
               document_mask: bool = False) -> str:
    """Write ``environment.json`` into the run folder; return the banner's lines: the versions
    in one line, then the one-time costs of the first steps."""
    info = environment()
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "environment.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    parts = [f"{name} {info.get(name)}" for name in ("lctrain", "torch", "triton", "transformers")]
    if info.get("gpu"):
        parts.append(_gpus(info))
    costs = one_time_costs(device_type, attention_backend, document_mask)
    return "; ".join(parts) + ("\nfirst steps: " + "; ".join(costs) if costs else "")
