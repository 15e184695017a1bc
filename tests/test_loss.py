"""chunked_cross_entropy against the plain full-logits cross-entropy, values and gradients."""
import pytest
import torch
import torch.nn.functional as F

from lctrain_kernels.api import chunked_cross_entropy


def _inputs(shape, vocab, hidden, dtype, ignore_frac=0.25):
    h = (torch.randn(*shape, hidden) * 2).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) / hidden**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, shape)
    labels[torch.rand(shape) < ignore_frac] = -100
    return h, w, labels


def _plain(h, w, labels):
    logits = (h @ w.T).float()
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def _value_and_grads(fn, h, w, labels, scale):
    loss = fn(h, w, labels)
    (loss * scale).backward()
    grads = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    return loss.detach(), grads


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 1000])
def test_fp32_matches_plain(chunk):
    h, w, labels = _inputs((2, 23), vocab=50, hidden=12, dtype=torch.float32)
    scale = 0.37  # a non-unit grad_output reaches both gradients
    ref, (rh, rw) = _value_and_grads(_plain, h, w, labels, scale)
    got, (gh, gw) = _value_and_grads(
        lambda a, b, c: chunked_cross_entropy(a, b, c, chunk), h, w, labels, scale)
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


def test_bf16_matches_plain_within_bf16_rounding():
    h, w, labels = _inputs((1, 70), vocab=96, hidden=32, dtype=torch.bfloat16)
    ref, (rh, rw) = _value_and_grads(_plain, h, w, labels, 1.0)
    got, (gh, gw) = _value_and_grads(
        lambda a, b, c: chunked_cross_entropy(a, b, c, 16), h, w, labels, 1.0)
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
    # bf16 gradients: a few ulps of bf16 (2**-8 relative), measured against the gradient scale
    for a, b in ((gh, rh), (gw, rw)):
        err = (a.float() - b.float()).abs().max() / b.float().abs().max()
        assert err < 2e-2, err


def test_all_ignored_chunks_give_zero_loss_and_gradient_there():
    h, w, labels = _inputs((1, 40), vocab=30, hidden=8, dtype=torch.float32, ignore_frac=0.0)
    labels[0, :24] = -100  # the first three chunks of 8 are fully ignored
    ref, (rh, rw) = _value_and_grads(_plain, h, w, labels, 1.0)
    got, (gh, gw) = _value_and_grads(
        lambda a, b, c: chunked_cross_entropy(a, b, c, 8), h, w, labels, 1.0)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    assert torch.count_nonzero(gh[0, :24]) == 0
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


def test_everything_ignored_is_zero_not_nan():
    h, w, labels = _inputs((3, 5), vocab=11, hidden=4, dtype=torch.float32)
    labels.fill_(-100)
    loss = chunked_cross_entropy(h, w, labels, 4)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_weight_without_grad_and_frozen_hidden():
    h, w, labels = _inputs((1, 9), vocab=13, hidden=6, dtype=torch.float32)
    w.requires_grad_(False)
    chunked_cross_entropy(h, w, labels, 4).backward()
    ref_h = h.grad.clone()
    h.grad = None
    _plain(h, w, labels).backward()
    torch.testing.assert_close(ref_h, h.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", ["chunk", "hidden", "labels", "dtype"])
def test_rejects_mismatched_inputs(bad):
    h, w, labels = _inputs((1, 9), vocab=13, hidden=6, dtype=torch.float32)
    args = {"chunk": (h, w, labels, 0), "hidden": (h, w[:, :5], labels, 4),
            "labels": (h, w, labels[:, :8], 4), "dtype": (h, w.double(), labels, 4)}[bad]
    with pytest.raises(ValueError):
        chunked_cross_entropy(*args)


def test_never_holds_more_than_one_chunk_of_logits():
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab, chunk = 37, 8

    class LargestVocabTensor(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == vocab:
                    self.rows = max(self.rows, t.shape[0])
            return out

    h, w, labels = _inputs((2, 50), vocab=vocab, hidden=6, dtype=torch.float32)
    with LargestVocabTensor() as mode:
        chunked_cross_entropy(h, w, labels, chunk).backward()
    assert mode.rows == chunk  # (chunk, V) logits, never (100, V)
