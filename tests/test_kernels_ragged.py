"""Ragged plans and the block logic around a ragged kernel: on a CPU through the plain-torch
engine against the float64 oracle on every mask shape and random blocks; on a GPU, the
cudnn_ragged backend in bf16 against float32 math, and the auto rule."""
import random

import pytest
import torch
import torch.distributed as dist

from fa_contract import fa_backward, fa_forward
from mask_cases import SHAPES, bounds_of, lognormal_lengths, random_block, visible
from lctrain_kernels import attention_with_lse, dist_attention_with_lse
from lctrain_kernels.backends import auto_order
from lctrain_kernels.distributed import make_schedule, shard
from lctrain_kernels.masks import MaskSpec, Relation, classify
from lctrain_kernels.backends.flash_attn_cute import CuteEngine, launches
from lctrain_kernels.ragged import RaggedBackend, RaggedCall, bucket, plan_ragged
from lctrain_kernels.reference import reference_backward, reference_forward
from spawn import run_on_ranks


class ReferenceEngine:
    """The ragged engine contract on the reference kernels, one entry at a time, any device:
    the block logic around a ragged kernel, checked on a CPU against the float64 oracle."""

    @staticmethod
    def _entries(call: RaggedCall):
        yield from zip(call.q_rows, call.k_rows, call.q_lens, call.k_lens)

    @staticmethod
    def _rows(x: torch.Tensor, r: int, n: int) -> torch.Tensor:
        return x.reshape(-1, *x.shape[2:])[r:r + n]  # (n, H, D) view of flattened rows

    def forward(self, call, q, k, v, out, lse_t, scale):
        spec = MaskSpec(call.causal)  # causal from the top-left corner
        for rq, rk, nq, nk in self._entries(call):
            o, lse = reference_forward(self._rows(q, rq, nq)[None], self._rows(k, rk, nk)[None],
                                       self._rows(v, rk, nk)[None], spec, scale)
            self._rows(out, rq, nq).copy_(o[0])
            lse_t[rq:rq + nq] = lse[0].transpose(0, 1)

    def backward(self, call, do, q, k, v, out, lse_t, dq, dk, dv, scale):
        spec = MaskSpec(call.causal)
        for rq, rk, nq, nk in self._entries(call):
            rows = [self._rows(x, rq, nq)[None] for x in (do, q)]
            keys = [self._rows(x, rk, nk)[None] for x in (k, v)]
            grads = reference_backward(*rows, *keys, self._rows(out, rq, nq)[None],
                                       lse_t[rq:rq + nq].transpose(0, 1)[None], spec, scale)
            for dst, r, n, grad in ((dq, rq, nq, grads[0]), (dk, rk, nk, grads[1]),
                                    (dv, rk, nk, grads[2])):
                self._rows(dst, r, n).copy_(grad[0])


def painted(plan, sq, sk, batch):
    """How many times each (query, key) pair of each batch row is in some entry."""
    hits = torch.zeros(batch, sq, sk, dtype=torch.int32)
    for call in plan.calls:
        for rq, rk, nq, nk in zip(call.q_rows, call.k_rows, call.q_lens, call.k_lens):
            b, i, j = rq // sq, rq % sq, rk % sk
            assert rk // sk == b and i + nq <= sq and j + nk <= sk  # inside its own row
            tri = torch.ones(nq, nk, dtype=torch.int32)
            hits[b, i:i + nq, j:j + nk] += tri.tril() if call.causal else tri
    return hits


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == \
        [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]


@pytest.mark.parametrize("name", list(SHAPES))
def test_plan_covers_each_visible_pair_exactly_once(name):
    spec, sq, sk = SHAPES[name]
    for batch in (1, 3):
        plan = plan_ragged(spec, sq, sk, batch)
        hits = painted(plan, sq, sk, batch)
        assert torch.equal(hits, visible(spec, sq, sk).int().expand(batch, sq, sk))
        assert [c.causal for c in plan.calls] == sorted((c.causal for c in plan.calls),
                                                        reverse=True)
        rows = [set() for _ in plan.calls]
        for call, seen in zip(plan.calls, rows):
            for r, n in zip(call.q_rows, call.q_lens):
                assert not seen & set(range(r, r + n))  # one call never writes a row twice
                seen |= set(range(r, r + n))
        assert plan.shared_rows == (len(rows) == 2 and bool(rows[0] & rows[1]))
        assert plan.covers_q == bool(hits.any(2).all())
        assert plan.covers_k == bool(hits.any(1).all())


def test_plan_on_random_blocks():
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    for _ in range(300):
        spec, sq, sk = random_block(rng)
        plan = plan_ragged(spec, sq, sk, 2)
        assert torch.equal(painted(plan, sq, sk, 2), visible(spec, sq, sk).int().expand(2, -1, -1))


def test_padded_batch_is_a_power_of_two_of_empty_entries_after_the_real_ones():
    spec = MaskSpec(True, 0, 0, bounds_of(5, 9, 3))
    (call,) = plan_ragged(spec, 17, 17).calls
    q_rows, k_rows, q_lens, k_lens = call.padded()
    assert (q_lens, k_lens) == ([5, 9, 3, 0], [5, 9, 3, 0])
    assert q_rows == k_rows == [0, 5, 14, 17, 17]
    assert (call.max_q, call.max_k) == (16, 16)


def run_block(spec, sq, sk, dtype, hq=4, hkv=2, batch=2, d=16, lse_grad=True):
    q = torch.randn(batch, sq, hq, d, dtype=dtype)
    k, v = (torch.randn(batch, sk, hkv, d, dtype=dtype) for _ in range(2))
    do = torch.randn_like(q)
    dlse = torch.randn(batch, hq, sq, dtype=dtype) if lse_grad else None
    return q, k, v, do, dlse


def check(spec, sq, sk, engine=None, **kw):
    """Forward, gradients and the lse's gradient through the ragged block logic on
    ``engine`` (the plain-torch one by default), against the float64 oracle."""
    q, k, v, do, dlse = run_block(spec, sq, sk, torch.float64, **kw)
    backend = RaggedBackend(engine or ReferenceEngine())
    scale, rel = 0.3, classify(spec, sq, sk)
    out, lse = backend.forward(q, k, v, spec, rel, scale)
    grads = backend.backward(do, q, k, v, out, lse, spec, rel, scale, dlse)
    ref_out, ref_lse = reference_forward(q, k, v, spec, scale)
    ref = reference_backward(do, q, k, v, ref_out, ref_lse, spec, scale, dlse=dlse)
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    assert not out[lse.isinf().transpose(1, 2)].any()
    seen = ref_lse.isfinite()
    assert (lse[seen] - ref_lse[seen]).abs().max() < 1e-10
    for got, want in zip((out, *grads), (ref_out, *ref)):
        assert got.dtype == torch.float64 and (got - want).abs().max() < 1e-10


# CPU engines: plain torch, and FlashAttention 4's launches on float64 math of its contract
BLOCK_ENGINES = {"reference": ReferenceEngine,
                 "flash_attn_cute": lambda: CuteEngine(fa_forward, fa_backward)}


@pytest.mark.parametrize("engine", list(BLOCK_ENGINES))
@pytest.mark.parametrize("name", list(SHAPES))
def test_block_logic_matches_float64_reference_on_every_mask_shape(name, engine, poisoned):
    spec, sq, sk = SHAPES[name]
    for hkv, batch in ((2, 2), (4, 1), (1, 1)):  # GQA, MHA, MQA; batched and not
        check(spec, sq, sk, engine=BLOCK_ENGINES[engine](), hkv=hkv, batch=batch)


@pytest.mark.parametrize("engine", list(BLOCK_ENGINES))
def test_block_logic_on_random_blocks(engine, poisoned):
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    for _ in range(40):
        spec, sq, sk = random_block(rng)
        if classify(spec, sq, sk) is Relation.EMPTY:  # never handed to a backend
            continue
        check(spec, sq, sk, engine=BLOCK_ENGINES[engine](), lse_grad=rng.random() < 0.5)


def test_shared_rows_are_merged_through_the_lse(poisoned):
    spec, sq, sk = SHAPES["offset_keys_into_queries"]
    assert plan_ragged(spec, sq, sk).shared_rows
    check(spec, sq, sk)


def test_auto_runs_masked_blocks_on_the_ragged_backends_first():
    half, part = torch.bfloat16, Relation.PARTIAL
    assert auto_order("cuda", half, part) == ("flash_attn_cute", "cudnn_ragged", "triton",
                                              "reference")
    assert auto_order("cuda", torch.float32, part)[2:] == ("triton", "reference")
    assert auto_order("cuda", half, Relation.CAUSAL)[:2] == ("flash_attn_cute", "cudnn")
    assert auto_order("cpu", half, part) == ("reference",)


class _Counting:
    """An engine that records (causal, entries, windowed launches) of every forward call."""

    calls: list = []

    def forward(self, call, *args):
        windows = sum(w.right is not None for w in launches(call))
        self.calls.append((call.causal, call.entries, windows))
        super().forward(call, *args)


class _CountingReference(_Counting, ReferenceEngine):
    pass


class _CountingCute(_Counting, CuteEngine):
    def __init__(self):
        super().__init__(fa_forward, fa_backward)


_ENGINES = {"reference": _CountingReference, "cute": _CountingCute}


def _ragged_on_cpu(engine: str):
    """In a rank process: the name "cudnn_ragged" resolves to the ragged block logic on a CPU
    engine (plain torch, or FlashAttention 4's launches on float64 math of its contract), so
    the executor's blocks take the path they take on a GPU."""
    import lctrain_kernels.backends as backends
    real = backends.get_backend
    backends.get_backend = lambda name: (RaggedBackend(_ENGINES[engine]())
                                         if name == "cudnn_ragged" else real(name))


def _dist_case(group, case: dict) -> float:
    """Largest relative error of out, lse and all gradients of dist_attention (ragged blocks)
    against the single-process float64 reference."""
    world = dist.get_world_size(group)
    gen = torch.Generator().manual_seed(case["seed"])
    n, hq, hkv, d = case["n"] * world, 4, case["hkv"], 16
    q, k, v, g = (torch.randn(1, n, h, d, generator=gen, dtype=torch.float64)
                  for h in (hq, hkv, hkv, hq))
    gl = torch.randn(1, hq, n, generator=gen, dtype=torch.float64)
    bounds = case["docs"](n)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = attention_with_lse(*ref, cu_seqlens=bounds, backend="reference")
    ((o * g).sum() + (lse * gl).sum() * case["lse"]).backward()
    layout = make_schedule(world, case["schedule"]).layout
    loc = [shard(t, group, layout).requires_grad_() for t in (q, k, v)]
    o_l, lse_l = dist_attention_with_lse(*loc, group=group, cu_seqlens=bounds,
                                         schedule=case["schedule"], backend="cudnn_ragged")
    loss = (o_l * shard(g, group, layout)).sum()
    (loss + (lse_l * shard(gl, group, layout, dim=2)).sum() * case["lse"]).backward()
    pairs = [(o_l, shard(o, group, layout)), (lse_l, shard(lse, group, layout, dim=2))]
    pairs += [(a.grad, shard(b.grad, group, layout)) for a, b in zip(loc, ref)]
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)


def _dist_worker(rank: int, world: int, phases, engine: str) -> list[dict]:
    _ragged_on_cpu(engine)
    results = []
    for ranks, cases in phases:
        group = dist.group.WORLD if ranks is None else dist.new_group(ranks)
        if ranks is None or rank in ranks:
            results.append({c["name"]: _dist_case(group, c) for c in cases})
    return results, _Counting.calls


def _crossing(n):  # documents across every chunk boundary, a short one among them
    return bounds_of(n // 3 + 5, 4, n // 2 - 20, n - (n // 3 + n // 2 - 11))


def _spanning(n):  # one document over all ranks
    return (0, n)


def _short_and_long(n):  # many short documents, then long ones
    return bounds_of(*([3, 6, 2, 7] * 3), (n - 54) // 2, n - 54 - (n - 54) // 2)


def _dist_cases(world: int, rng: random.Random) -> list[dict]:
    runs = [("distflash", _crossing), ("distflash", _spanning), ("distflash", _short_and_long),
            ("zigzag", _crossing), ("ring", _short_and_long)]
    return [dict(name=f"P={world}/{sched}/{docs.__name__}", seed=rng.randrange(1 << 30),
                 schedule=sched, docs=docs, n=48, hkv=(4, 2, 1)[i % 3], lse=float(i % 2))
            for i, (sched, docs) in enumerate(runs)]


@pytest.mark.parametrize("engine", list(_ENGINES))
def test_dist_attention_runs_ragged_blocks_exactly_at_two_and_three_ranks(engine):
    """Every block the schedules make (diagonal, off-diagonal, the halves of a helped block)
    through the ragged block logic, over gloo, against the single-process float64 reference;
    on the plain-torch engine and on FlashAttention 4's launches (float64 math of its kernels'
    contract)."""
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    phases = [(None, _dist_cases(3, rng)), ([0, 2], _dist_cases(2, rng))]
    per_rank = run_on_ranks(_dist_worker, 3, phases, engine)
    for rank, (results, calls) in enumerate(per_rank):
        expected = [phases[0][1]] + ([phases[1][1]] if rank in (0, 2) else [])
        assert [set(r) for r in results] == [{c["name"] for c in cs} for cs in expected]
        bad = {name: err for r in results for name, err in r.items() if not err < 1e-10}
        assert not bad, bad
        assert {causal for causal, _, _ in calls} == {True, False}  # diagonal, off-diagonal
        assert max(n for _, n, _ in calls) > 1  # blocks of several documents
        assert any(w for _, _, w in calls)  # a taller causal piece: a helped block's half


def test_cudnn_ragged_steps_aside_for_deterministic_algorithms():
    """With torch.use_deterministic_algorithms on, the backend refuses (auto then runs triton,
    whose backward is deterministic); the rule is checked before any device test."""
    from lctrain_kernels.backends.cudnn_ragged import CudnnRaggedBackend
    backend = object.__new__(CudnnRaggedBackend)  # the rule needs no GPU
    spec, sq, sk = SHAPES["many_short"]
    q, k, v = torch.randn(1, sq, 2, 16), torch.randn(1, sk, 2, 16), torch.randn(1, sk, 2, 16)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert "deterministic" in backend.unsupported(q, k, v, spec, Relation.PARTIAL)
    finally:
        torch.use_deterministic_algorithms(before)
    assert "CUDA only" in backend.unsupported(q, k, v, spec, Relation.PARTIAL)


MIXES = {
    "many_short": lambda n: [n // 32] * 32,
    "few_long": lambda n: [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8],
    "lognormal": lambda n: lognormal_lengths(n, n / 6, 1.0, 3),
}


def gpu_case(spec, sq, sk, hq, hkv, d=128, batch=1, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    do = torch.randn_like(q)
    dlse = torch.randn(batch, hq, sq, device="cuda")
    return q, k, v, do, dlse


def gpu_errors(backend, spec, q, k, v, do, dlse):
    """Largest error of out, lse and every gradient against float32 math, relative to the
    largest reference value."""
    sq, sk, scale = q.shape[1], k.shape[1], q.shape[-1] ** -0.5
    rel = classify(spec, sq, sk)
    out, lse = backend.forward(q, k, v, spec, rel, scale)
    grads = backend.backward(do, q, k, v, out, lse, spec, rel, scale, dlse)
    up = [t.float() for t in (q, k, v, do)]
    ref_out, ref_lse = reference_forward(*up[:3], spec, scale)
    ref = reference_backward(up[3], *up[:3], ref_out, ref_lse, spec, scale, dlse=dlse)
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    seen = ref_lse.isfinite()
    errs = [((lse[seen] - ref_lse[seen]).abs().max() / ref_lse[seen].abs().max()).item()]
    for got, want in zip((out, *grads), (ref_out, *ref)):
        assert got.shape == want.shape
        errs.append(((got.float() - want).abs().max() / want.abs().max()).item())
    return errs


def gpu_backend(name):
    from lctrain_kernels.backends import BackendUnavailable, get_backend
    try:
        return get_backend(name)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))


RAGGED = ("cudnn_ragged", "flash_attn_cute")


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", RAGGED)
@pytest.mark.parametrize("name", list(SHAPES))
def test_gpu_ragged_backends_match_float32_math_on_every_mask_shape(name, backend_name):
    spec, sq, sk = SHAPES[name]
    backend = gpu_backend(backend_name)
    for hq, hkv, batch in ((8, 2, 2), (4, 4, 1)):
        errs = gpu_errors(backend, spec, *gpu_case(spec, sq, sk, hq, hkv, batch=batch))
        assert max(errs) < 2e-2, errs


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", RAGGED)
@pytest.mark.parametrize("mix", list(MIXES))
def test_gpu_ragged_backends_on_document_mixes_and_head_group_views(mix, backend_name):
    """A diagonal block (two batch rows), an off-diagonal one (a document crossing the chunk
    boundary) and a half-keys one, at 4K rows; q, k, v as head-group slices of wider tensors.
    Equal documents run as a plain batch on the dense kernel, the others ragged."""
    from lctrain_kernels.ragged import plan_ragged
    n = 4096
    bounds = bounds_of(*MIXES[mix](2 * n))
    backend = gpu_backend(backend_name)
    for spec, sk, batch in ((MaskSpec(True, n, n, bounds), n, 2),
                            (MaskSpec(True, n, 0, bounds), n, 1),
                            (MaskSpec(True, n, n, bounds), n // 2, 1)):
        if classify(spec, n, sk) is Relation.EMPTY:  # never handed to a backend
            continue
        calls = plan_ragged(spec, n, sk, batch).calls
        if batch == 2:  # several documents: equal ones are a plain batch, others ragged
            assert any(c.uniform for c in calls) == (mix == "many_short")
        q, k, v, do, dlse = gpu_case(spec, n, sk, 16, 4, batch=batch)
        q, k, v = q[:, :, 4:12], k[:, :, 1:3], v[:, :, 1:3]  # strided head-group views
        do, dlse = do[:, :, :8].contiguous(), dlse[:, :8].contiguous()
        errs = gpu_errors(backend, spec, q, k, v, do, dlse)
        assert max(errs) < 2e-2, (spec.q_start, sk, errs)


def _blocks(bounds, n):
    """The blocks of a 2n-token sequence that the tests run: diagonal, off-diagonal (documents
    crossing the chunk boundary), and diagonal against half its keys (taller pieces)."""
    return [(spec, sk) for spec, sk in ((MaskSpec(True, n, n, bounds), n),
                                        (MaskSpec(True, n, 0, bounds), n),
                                        (MaskSpec(True, n, n, bounds), n // 2))
            if classify(spec, n, sk) is not Relation.EMPTY]


@pytest.mark.gpu
def test_gpu_flash_attention_4_compiles_nothing_new_for_other_document_layouts():
    """FlashAttention 4 compiles one kernel per key; a launch whose longest entry fit one tile
    had a key of its own, so where documents fell decided what a step compiled. After one layout
    of long pieces, layouts whose pieces are a few rows at every boundary compile nothing more
    (and match float32 math)."""
    backend = gpu_backend("flash_attn_cute")
    from flash_attn.cute import interface
    caches = [getattr(interface, name).compile_cache.cache
              for name in ("_flash_attn_fwd", "_flash_attn_bwd")]
    n = 4096

    def run(bounds):
        for spec, sk in _blocks(bounds, n):
            errs = gpu_errors(backend, spec, *gpu_case(spec, n, sk, 8, 2, batch=1))
            assert max(errs) < 2e-2, (bounds, spec, sk, errs)

    run(bounds_of(2000, 4000, 2192))
    compiled = [len(cache) for cache in caches]
    rng = random.Random(int(torch.randint(0, 1 << 30, ())))
    for _ in range(3):  # a few rows either side of the chunk boundary and of the half-keys one
        a, b, c = (rng.randint(1, 60) for _ in range(3))
        tiny = [rng.randint(1, 60) for _ in range(rng.randint(1, 4))]
        lengths = [n - a, a + b, *tiny, n // 2 - b - sum(tiny) + c]
        run(bounds_of(*lengths, 2 * n - sum(lengths)))
    assert [len(cache) for cache in caches] == compiled


@pytest.mark.gpu
def test_gpu_auto_runs_document_masks_on_a_ragged_backend_through_the_attention_api():
    """The model's path: attention() with cu_seqlens under autograd, q/k/v transposed views of
    (B, H, S, D) tensors as the model hands them over; auto picks flash_attn_cute where it is
    installed, else cudnn_ragged."""
    from lctrain_kernels import attention_with_lse
    from lctrain_kernels.backends import available_backends, select_backend
    bounds = bounds_of(700, 1300, 96, 2000)
    spec = MaskSpec(True, 0, 0, bounds)
    heads = [torch.randn(1, h, bounds[-1], 64, device="cuda",
                         dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2)]
    q, k, v = (x.transpose(1, 2) for x in heads)
    first = next((n for n in RAGGED[::-1] if n in available_backends()), None)
    if first is None:
        pytest.skip("neither flash_attn_cute nor cudnn_ragged is installed")
    assert select_backend("auto", q, k, v, spec, Relation.PARTIAL).name == first
    out, lse = attention_with_lse(q, k, v, cu_seqlens=list(bounds))
    do = torch.randn_like(out)
    (out.float() * do).sum().backward()
    up = [x.detach().float().transpose(1, 2) for x in heads]
    ref_out, ref_lse = reference_forward(*up, spec, 64 ** -0.5)
    ref = reference_backward(do.float(), *up, ref_out, ref_lse, spec, 64 ** -0.5)
    assert (lse - ref_lse).abs().max() < 1e-2
    for got, want in zip((out, *(x.grad.transpose(1, 2) for x in heads)), (ref_out, *ref)):
        assert ((got.float() - want).abs().max() / want.abs().max()) < 2e-2
