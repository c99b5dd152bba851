"""The vocabulary-sliced loss (slimopt.train.vocab_chunked_loss) against the usual one on the full logits."""

import pytest
import torch
import torch.nn.functional as F
from helpers import batches, tiny_llama

from slimopt.train.evaluate import lm_loss
from slimopt.train.vocab_chunked_loss import IGNORE, causal_lm_loss, linear_cross_entropy
from slimopt.weights.row_grads import RowRoute, route_rows


@pytest.mark.parametrize("slice_rows", [1, 7, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_cross_entropy_on_full_logits(slice_rows, dtype):
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(64, 16, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 64, (2, 9))
    target[:, -1] = IGNORE
    target[0, 3] = 63  # the last row of the vocabulary, in the last (short) slice
    ref_h, ref_w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy((ref_h @ ref_w.t()).float().reshape(-1, 64), target.reshape(-1), ignore_index=IGNORE)
    loss = linear_cross_entropy(hidden, weight, target, slice_rows)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    # a slice's bf16 logits need not round like the whole product's on every processor (the GEMM's blocking):
    # within bf16's half-ulp (2^-9) of the logits, averaged
    torch.testing.assert_close(loss, ref, **(dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32
                                             else dict(rtol=4e-3, atol=0.0)))
    (loss * 3).backward()
    (ref * 3).backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad, **tol)
    torch.testing.assert_close(weight.grad, ref_w.grad, **tol)


def test_a_llama_scores_and_trains_as_with_lm_loss():
    model, twin = tiny_llama(seed=0), tiny_llama(seed=0)
    ids = batches(1, seed=2)[0]
    loss, ref = causal_lm_loss(model, ids, slice_rows=10), lm_loss(twin, ids)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_route_receives_the_whole_gradient_a_slice_at_a_time(dtype):
    """With a row route (weights/row_grads.py) the weight's gradient is not returned: each slice's rows reach the
    route, together bit for bit the gradient returned without one; ready() runs before the forward pass reads
    the weight, done() once after the last slice."""
    torch.manual_seed(1)
    hidden = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 50, (3, 5))
    linear_cross_entropy(hidden, weight, target, slice_rows=16).backward()
    whole, whole_hidden = weight.grad.clone(), hidden.grad.clone()
    weight.grad = hidden.grad = None
    calls, got = [], torch.full_like(weight, float("nan"))

    def rows(start, grad):
        calls.append(("rows", start, grad.shape[0]))
        got[start: start + grad.shape[0]] = grad

    handle = route_rows(weight, RowRoute(ready=lambda: calls.append(("ready",)), rows=rows,
                                         done=lambda: calls.append(("done",))))
    loss = linear_cross_entropy(hidden, weight, target, slice_rows=16)
    assert calls == [("ready",)]
    loss.backward()
    assert calls[1:] == [("rows", 0, 16), ("rows", 16, 16), ("rows", 32, 16), ("rows", 48, 2), ("done",)]
    assert weight.grad is None and torch.equal(got, whole) and torch.equal(hidden.grad, whole_hidden)
    handle.remove()
    weight.grad = None
    linear_cross_entropy(hidden, weight, target, slice_rows=16).backward()
    assert torch.equal(weight.grad, whole) and len(calls) == 6  # the route is off: returned whole again


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="slice_rows"):
        linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="do not pair up"):
        linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(4, dtype=torch.long))


def _peak(fn) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_the_peak_holds_one_slice_not_the_logits():
    torch.manual_seed(0)
    n, h, vocab = 512, 64, 8192
    weight = torch.randn(vocab, h, requires_grad=True)
    target = torch.randint(0, vocab, (n,))
    logits_bytes = n * vocab * 4  # 16 MiB

    def full():
        hidden = torch.randn(n, h, requires_grad=True)
        F.cross_entropy(hidden @ weight.t(), target).backward()

    def sliced():
        hidden = torch.randn(n, h, requires_grad=True)
        linear_cross_entropy(hidden, weight, target, slice_rows=512).backward()

    weight.grad = None
    full_peak = _peak(full)
    weight.grad = None
    sliced_peak = _peak(sliced)
    assert full_peak - sliced_peak > 2 * logits_bytes  # the logits, their gradient: gone
    assert sliced_peak < 2 * weight.numel() * 4 + 6 * n * 512 * 4 + n * h * 16  # weight, its grad, a slice's work
