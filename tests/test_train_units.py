"""Small pieces of the training path: schedule, mesh sizes, metrics log, launch checks and errors."""
from __future__ import annotations

import hashlib
import json
import math

import pytest

from lctrain.config import load_recipe
from lctrain.errors import UserError
from lctrain.parallel.mesh import build_mesh, check_parallel_sizes
from lctrain.train import finetune
from lctrain.launch.failures import read_records
from lctrain.launch.rank import check_accelerate_mode
from lctrain.train.metrics import MetricsLog
from lctrain.train.optim import LrPlan


def test_warmup_then_cosine_to_floor():
    f = LrPlan(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_parallel_sizes():
    assert check_parallel_sizes(8, 2) == (4, 2)
    assert check_parallel_sizes(6, 3) == (2, 3)
    with pytest.raises(UserError, match="world size 3 is not divisible by parallel.cp = 2"):
        check_parallel_sizes(3, 2)
    with pytest.raises(UserError, match="parallel.cp must be at least 1"):
        check_parallel_sizes(8, 0)
    alone = build_mesh(cp=1)  # no process group: a one-rank view without groups
    assert (alone.dp, alone.cp, alone.rank, alone.cp_group, alone.world_group) == (1, 1, 0, None, None)


def test_metrics_log_truncates_fresh_and_trims_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, enabled=True, resume_step=None)
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step, "mfu": float("nan")})
    assert json.loads(path.read_text().splitlines()[0]) == {"step": 1, "loss": 1.0, "mfu": None}
    MetricsLog(path, enabled=True, resume_step=2)  # resumed from step 2: step 3 is redone
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    MetricsLog(path, enabled=True, resume_step=None)
    assert path.read_text() == ""


def test_a_resume_drops_the_line_a_full_disk_cut_short(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    MetricsLog(path, enabled=True, resume_step=2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert "cut short" in capsys.readouterr().err


def test_accelerate_must_not_shard_the_model_itself():
    from accelerate.utils import DistributedType

    for mode in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        with pytest.raises(UserError, match=f"set up for {mode.value}.*shards the model itself"):
            check_accelerate_mode(mode)
    for mode in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        check_accelerate_mode(mode)


def test_a_lone_worker_process_is_a_one_rank_group_whose_accelerator_scales_nothing(
        tmp_path, monkeypatch):
    """accelerate reads its accumulation steps from the environment; the loop accumulates
    itself, so the worker's accelerator must keep one step (no loss scaling) regardless."""
    import torch
    import torch.distributed as dist

    from lctrain.launch.rank import worker_process

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    assert not dist.is_initialized()
    with worker_process(_tiny(tmp_path)) as accelerator:
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert accelerator.gradient_accumulation_steps == 1
        assert accelerator.mixed_precision == "no" and accelerator.device.type == "cpu"
        x = torch.randn(5, requires_grad=True)
        plain = x.detach().clone().requires_grad_()
        accelerator.backward((x * x).sum() / 3.0)
        ((plain * plain).sum() / 3.0).backward()  # what the loop did before accelerate ran it
        torch.testing.assert_close(x.grad, plain.grad, rtol=0, atol=0)
    assert not dist.is_initialized()  # the group made for the block is gone


def test_error_records_are_read_earliest_first(tmp_path):
    assert read_records(tmp_path) == []
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "time": 5.0, "message": "reset"}))
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "time": 2.0, "message": "real"}))
    assert [r["message"] for r in read_records(tmp_path)] == ["real", "reset"]


def _tiny(tmp_path, *sets):
    return load_recipe(None, ["data.seq_len=64", "train.max_steps=1", *sets],
                       output_dir=str(tmp_path / "run"))


def test_launch_errors_before_any_process(tmp_path):
    with pytest.raises(UserError, match="world size 3 is not divisible by parallel.cp = 2"):
        finetune(_tiny(tmp_path), nproc=3)
    from lctrain.bench.step import _expectations  # bench step's row: processes, not GPUs

    with pytest.raises(UserError, match="^the world size 3 is not divisible by parallel.cp = 2"):
        _expectations(_tiny(tmp_path), 3, 1.0)
    with pytest.raises(UserError, match="there is no run to resume"):
        finetune(_tiny(tmp_path), resume=True)
    (tmp_path / "run" / "checkpoints" / "step-00000001").mkdir(parents=True)
    with pytest.raises(UserError, match="already holds checkpoints"):
        finetune(_tiny(tmp_path))


def test_self_launch_reports_the_ranks_error(tmp_path):
    """A failure inside the torchrun workers comes back as the rank's own one-sentence error."""
    cfg = _tiny(tmp_path, "model.config.model_type=not-a-model")
    with pytest.raises(UserError, match="model_type 'not-a-model' is not a model type"):
        finetune(cfg, nproc=2)


def test_flop_model_counts_documents_not_the_whole_row():
    import torch
    from transformers import LlamaConfig

    from lctrain.data import PackedBatch
    from lctrain.train.loop import attention_units
    from lctrain.model.flops import FlopModel

    ids = torch.zeros(1, 96, dtype=torch.long)
    docs = PackedBatch(ids, ids, ids, (0, 30, 71, 96))
    plain = PackedBatch(ids.expand(2, 96), ids.expand(2, 96), ids.expand(2, 96), None)
    assert attention_units([docs]) == 30**2 + 41**2 + 25**2
    assert attention_units([docs, plain]) == 30**2 + 41**2 + 25**2 + 2 * 96**2
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3)
    model = FlopModel.for_model(cfg, n_matmul_params=1000)
    assert (model.per_token, model.per_attention_unit) == (6000.0, 7.0 * 3 * 4 * 16)
    assert model.total(10, 5) == 10 * 6000.0 + 5 * 7.0 * 3 * 4 * 16


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_flop_model_counts_what_autograd_multiplies(lora_rank):
    """Matrix FLOPs of one forward and backward, counted by torch's FlopCounterMode on a tiny
    model, are the FLOP model's per-token figure × tokens: 6 per trained weight, 4 per frozen one
    (LoRA's base weights pass gradients to their inputs but get none themselves)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from lctrain.config.schema import LoraConfig
    from lctrain.model.lora import apply_lora
    from lctrain.parallel.build import _flop_model

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=3, vocab_size=200)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    if lora_rank:  # a trained embedding copy: every layer's input then needs a gradient
        model = apply_lora(model, LoraConfig(rank=lora_rank, trainable_modules=("embed_tokens",)),
                           seed=1)
    tokens = 48
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.float().sum().backward()
    counts = counter.get_flop_counts()["Global"]
    matrix = sum(v for op, v in counts.items() if str(op) in ("aten.mm", "aten.addmm"))
    per_token = _flop_model(model).per_token
    assert matrix / tokens == pytest.approx(per_token, rel=0.02)  # norms: the model's rounding
    full = 6 * sum(p.numel() for n, p in model.named_parameters()
                   if "embed_tokens" not in n and "lora_" not in n)
    assert (per_token < 0.9 * full) == bool(lora_rank)  # 4 of 6 per frozen weight


def test_a_worker_refuses_a_recipe_that_changed_after_the_launcher_wrote_it(tmp_path):
    from lctrain.config import save_resolved
    from lctrain.launch.rank import read_recipe

    path = tmp_path / "recipe.yaml"  # as the launcher writes it
    save_resolved(load_recipe(None, ["train.lr=0.002"]), path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert read_recipe(str(path), digest).train.lr == 0.002
    path.write_text(path.read_text().replace("lr: 0.002", "lr: 0.5"))
    with pytest.raises(UserError, match="changed after the launcher wrote it"):
        read_recipe(str(path), digest)


def test_self_launched_ranks_use_growing_allocator_segments_unless_told(monkeypatch):
    from lctrain.launch.launcher import _worker_env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert _worker_env(2)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert _worker_env(2)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_self_launched_ranks_keep_compiled_fa4_kernels_unless_told(monkeypatch):
    from lctrain.launch.launcher import _worker_env

    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    assert _worker_env(2)["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    assert _worker_env(2)["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"
