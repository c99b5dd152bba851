"""Degenerate identities that pin the composition: no projector == AdamW, density 1 == AdamW, density 0 == signSGD."""

import torch
from helpers import assert_params_close, backward, batches, run, twins

import slimopt


def test_no_projector_equals_torch_adamw():
    a, b = twins()
    data = batches(12)
    opt_a = slimopt.build(a, "adamw", lr=3e-3, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-7)
    opt_b = torch.optim.AdamW(b.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-7)
    la, lb = run(a, opt_a, data), run(b, opt_b, data)
    assert_params_close(a, b)
    torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-5, atol=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_a.state[pa][key], opt_b.state[pb][key], rtol=1e-5, atol=1e-8)
        assert float(opt_a.state[pa]["step"]) == float(opt_b.state[pb]["step"]) == 12


def test_frugal_density_one_equals_adamw():
    a, b = twins()
    data = batches(10)
    opt_a = slimopt.build(a, "frugal", density=1.0, lr=2e-3, weight_decay=0.05)
    opt_b = torch.optim.AdamW(b.parameters(), lr=2e-3, weight_decay=0.05)
    run(a, opt_a, data), run(b, opt_b, data)
    assert_params_close(a, b)


def test_frugal_svd_density_one_equals_adamw_up_to_rotation():
    # a full-rank orthonormal projection is a rotation: Adam in rotated coordinates is not Adam, but sgdm is.
    a, b = twins()
    data = batches(6)
    opt_a = slimopt.build(a, "frugal", projector="svd", density=1.0, rule="sgdm", momentum=0.9, lr=1e-2,
                          update_gap=100)
    opt_b = torch.optim.SGD(b.parameters(), lr=1e-2, momentum=0.9)  # rule is shared: every group runs sgdm
    run(a, opt_a, data), run(b, opt_b, data)
    assert_params_close(a, b, rtol=1e-4, atol=1e-5)


def test_frugal_density_zero_is_signsgd_plus_adamw():
    # Both sides step on a's gradients. With each model's own backward, the two Adam implementations (which round
    # apart by an ulp) make the twins' gradients differ by up to 1e-8 after one step, while some projectable
    # entries are as small as 1e-9: sign() would then follow the processor's last bit. On the same gradients the
    # signs are the same by construction, and the identity (density 0 == signSGD there, AdamW elsewhere) is
    # checked as tightly as before.
    a, b = twins()
    data = batches(10)
    lr, wd = 1e-3, 0.01
    opt_a = slimopt.build(a, "frugal_rho0", lr=lr, weight_decay=wd)
    kinds = {g["name"]: g["names"] for g in opt_a.param_groups}
    projectable = set(kinds["projectable"])
    params_b = dict(b.named_parameters())
    adam_b = torch.optim.AdamW([p for n, p in params_b.items() if n not in projectable], lr=lr, weight_decay=wd)
    for ids in data:
        backward(a, ids)
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.grad = pa.grad.clone()
        opt_a.step()
        adam_b.step()
        with torch.no_grad():
            for n in projectable:
                p = params_b[n]
                p.mul_(1 - lr * wd).add_(p.grad.sign(), alpha=-lr)
    assert_params_close(a, b)
    for n, p in a.named_parameters():
        if n in projectable:
            assert set(opt_a.state[p]) == {"step"}, "density 0 keeps no moments on projectable weights"


def test_signsgd_method_has_no_state_but_step():
    a, _ = twins()
    opt = slimopt.build(a, "signsgd")
    run(a, opt, batches(2))
    assert all(set(s) == {"step"} for s in opt.state.values())
    assert slimopt.state_nbytes(opt) == 4 * len(list(a.parameters()))
