"""slimopt.GaLoreAdamW equals galore_torch.GaLoreAdamW on its two-group layout across several refreshes."""

import pytest
import torch

import slimopt
from slimopt.optim.partition import classify
from helpers import assert_params_close, backward, batches, twins

galore_torch = pytest.importorskip("galore_torch")


def _groups(model, proj_type):
    kinds = classify(model)
    lowrank = [p for p, k in kinds.values() if k == "projectable"]
    rest = [p for p, k in kinds.values() if k != "projectable"]
    return [{"params": rest},
            {"params": lowrank, "rank": 4, "update_proj_gap": 3, "scale": 0.25, "proj_type": proj_type}]


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right"])
def test_galore_adamw_matches_galore_torch(proj_type):
    a, b = twins()
    # eps is added before galore-torch's bias correction and after ours: tiny eps makes that irrelevant
    ours = slimopt.GaLoreAdamW(_groups(a, proj_type), lr=1e-2, eps=1e-12)
    theirs = galore_torch.GaLoreAdamW(_groups(b, proj_type), lr=1e-2, eps=1e-12, no_deprecation_warning=True)
    for ids in batches(8):  # refreshes at steps 1, 4, 7
        backward(a, ids)
        backward(b, ids)
        ours.step()
        theirs.step()
    assert_params_close(a, b, rtol=1e-5, atol=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[pa][key], theirs.state[pb][key], rtol=1e-4, atol=1e-7)


def test_trainer_style_groups_become_svd_groups():
    a, _ = twins()
    opt = slimopt.GaLoreAdamW(_groups(a, "std"))
    g = opt.param_groups[1]
    assert (g["projector"], g["rank"], g["update_gap"], g["scale"], g["proj_side"]) == ("svd", 4, 3, 0.25, "std")
    assert opt.param_groups[0]["projector"] == "none"
