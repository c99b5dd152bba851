"""A CUDA step makes the host wait for nothing between subspace refreshes, asked without a GPU: CPU tensors take the
CUDA route with the Triton launches stubbed out, and every operation that would synchronize a CUDA device is
recorded (tests/sync_free_worker.py, in a process of its own). On a GPU, benchmarks/gpu_step_checks.py asks the same
under torch.cuda.set_sync_debug_mode("error")."""

import pytest
from launch import interpreted_worker

import slimopt

# the subspace methods whose refresh is a decomposition: its finite checks keep the previous subspace when a
# gradient or the decomposition is not finite, which needs the answer on the host
DECOMPOSING = {"galore", "galore_rsvd", "galore8bit", "galore kahan"}


@pytest.fixture(scope="module")
def report():
    return interpreted_worker("sync_free_worker.py")


def test_the_trap_sees_each_way_of_reading_a_device_value(report):
    found = " | ".join(report["control"])
    for why in ("reads a value on the host", "index.Tensor with a boolean mask", "index_put_", "Tensor.tolist()"):
        assert why in found, (why, found)


def test_every_method_took_the_cuda_route(report):
    methods = [m for m in report if m != "control"]
    assert set(slimopt.methods()) <= set(methods)
    for method in methods:  # every method steps at least its embeddings, norms and head through the kernel
        assert report[method]["launches between refreshes"] > 0, method


def test_no_step_between_refreshes_synchronizes(report):
    for method, r in report.items():
        if method != "control":
            assert r["between refreshes"] == [], (method, r["between refreshes"])


def test_a_refresh_synchronizes_only_in_a_decomposition_s_finite_checks(report):
    for method, r in report.items():
        if method == "control":
            continue
        if method in DECOMPOSING:
            # the two finite checks around a decomposition (sharded_bases.decompose_checked), which keep the subspace
            assert r["refresh"] and all("sharded_bases.py" in x and " decompose_checked" in x for x in r["refresh"]), \
                (method, r["refresh"])
        else:  # random bases, coordinates, blocks: drawn from the stream without looking at the gradient
            assert r["refresh"] == [], (method, r["refresh"])
