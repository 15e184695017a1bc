"""Kernel categories of `lctrain bench step --profile` (`lctrain.train.step_profile`), on kernel
names an H200 training step ran, and the summary built from per-kernel times."""
from types import SimpleNamespace

import pytest
import torch

from lctrain.train.step_profile import category, own_times, report, summarize

H200_KERNELS = [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_"
     "cga1x1x1_kernel0_0", "attention"),
    ("attn_bwd_dkdv_kernel", "attention"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "matmul"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("Memcpy DtoH (Device -> Pinned)", "copies"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous "
     "namespace)::OpaqueType<2u>, unsigned int, 4, 64, 64>(", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
     "pow_tensor_scalar_kernel_impl<float, float>(", "other"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::addmm", "matmul"),
]


@pytest.mark.parametrize("name, expected", H200_KERNELS)
def test_kernel_names_fall_in_their_category(name, expected):
    assert category(name) == expected


def test_summary_sums_each_category_and_lists_the_largest_kernels_first():
    times = {name: (float(i + 1), i + 2) for i, (name, _) in enumerate(H200_KERNELS)}
    summary = summarize(times, wall_ms=100.0)
    want = {"attention": 0.0, "matmul": 0.0, "communication": 0.0, "copies": 0.0, "other": 0.0}
    for i, (_, cat) in enumerate(H200_KERNELS):
        want[cat] += i + 1
    assert summary["categories_ms"] == want
    assert [k["ms"] for k in summary["top"]] == sorted((t for t, _ in times.values()), reverse=True)
    assert summary["top"][0] == {"name": H200_KERNELS[-1][0], "category": "matmul",
                                 "ms": 10.0, "count": 11}
    lines = report(summary).splitlines()
    assert lines[0] == "step wall time: 100.0 ms"
    assert [l.split() for l in lines if l.startswith("  attention")] == [
        ["attention", "12.0", "ms", "12.0", "%", "of", "the", "wall", "time"]]


def test_gpu_time_counts_kernels_once_and_not_the_ranges_around_them():
    """On a GPU, key_averages also lists operators (CPU) and named ranges on the GPU's timeline
    (the optimizer's step, which spans its kernels); only kernels count."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(key, device, us, annotation=False):
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=us,
                               self_cpu_time_total=us, count=2, is_user_annotation=annotation)

    events = [event("_rms_norm_fwd", cuda, 3000), event("Optimizer.step#AdamW.step", cuda, 900000,
                                                        annotation=True),
              event("aten::add", cpu, 5000)]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert own_times(prof, cuda=True) == {"_rms_norm_fwd": (3.0, 2)}
    assert own_times(prof, cuda=False) == {"_rms_norm_fwd": (3.0, 2), "Optimizer.step#AdamW.step":
                                           (900.0, 2), "aten::add": (5.0, 2)}


def test_profiling_and_writing_the_last_step_are_not_its_time(tmp_path, monkeypatch):
    """One real CPU run, profiled: writing the profile (slowed by 2 s here) stays out of the
    step's logged time, which still holds the profiled step itself."""
    import json
    import time

    from lctrain.config import load_recipe
    from lctrain.train import step_profile
    from lctrain.train.runner import finetune

    real = step_profile.summarize

    def slow(*args, **kwargs):
        time.sleep(2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(step_profile, "summarize", slow)
    monkeypatch.setenv(step_profile.ENV, str(tmp_path / "prof"))
    sets = {"data.seq_len": 128, "data.max_documents": 8, "train.warmup_steps": 1,
            "train.max_steps": 2, "parallel.cp": 1, "checkpoint.keep": 0}
    cfg = load_recipe(None, [f"{k}={v}" for k, v in sets.items()], output_dir=str(tmp_path / "run"))
    assert finetune(cfg, nproc=1) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    step = [json.loads(line) for line in lines][-1]["step_time_s"]
    wall = json.loads((tmp_path / "prof" / "rank0-step2-kernels.json").read_text())["wall_ms"]
    assert wall / 1e3 <= step < wall / 1e3 + 1.5
