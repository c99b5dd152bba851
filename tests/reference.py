"""A slow, plain reference of SlimOptimizer's step (fp32 moments), written for reading, not speed.

Each parameter is handled with explicit, separate code paths; random choices (bases, coordinates, active blocks)
come from the same seeded choice functions as the library so both see the same subspaces, while the arithmetic of
the step (projections, moments, bias corrections, residual, decay) is written out again here.
"""

from __future__ import annotations

import math

import torch

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.optimizer import DEFAULTS


class ReferenceOptimizer:
    def __init__(self, params, **settings):
        params = list(params)
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        self.groups = [{**DEFAULTS, **settings, **g, "params": list(g["params"])} for g in params]
        self.state = {}
        index = 0
        self.where = {}
        for g in self.groups:
            for i, p in enumerate(g["params"]):
                self.where[p] = (i, index)
                index += 1

    def moments_of(self, rule):
        return {"adamw": ["exp_avg", "exp_avg_sq"], "lion": ["exp_avg"], "sgdm": ["momentum_buffer"]}[rule]

    def rule(self, group, st, g):
        """Update st's moments with gradient g (fp32); return the update direction times its coefficient."""
        st["moment_step"] += 1
        t = int(st["moment_step"])
        b1, b2 = group["betas"]
        if group["rule"] == "adamw":
            st["exp_avg"] = b1 * st["exp_avg"] + (1 - b1) * g
            st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + (1 - b2) * g * g
            m_hat = st["exp_avg"] / (1 - b1 ** t)
            v_hat = st["exp_avg_sq"] / (1 - b2 ** t)
            eps = group["eps"]
            if group["eps_placement"] == "galore":  # sqrt(v) + eps, then the bias correction
                eps = eps / math.sqrt(1 - b2 ** t)
            return m_hat / (torch.sqrt(v_hat) + eps)
        if group["rule"] == "lion":
            d = torch.sign(b1 * st["exp_avg"] + (1 - b1) * g)
            st["exp_avg"] = b2 * st["exp_avg"] + (1 - b2) * g
            return d
        st["momentum_buffer"] = group["momentum"] * st["momentum_buffer"] + g
        return st["momentum_buffer"].clone()

    def zero_moments(self, group, st, shape):
        for k in self.moments_of(group["rule"]):
            st[k] = torch.zeros(shape, dtype=torch.float64)
        st["moment_step"] = torch.zeros(())

    @torch.no_grad()
    def step(self):
        for group in self.groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(group, p)

    def update(self, group, p):
        g = p.grad.clone()
        st = self.state.setdefault(p, {"step": torch.zeros(())})
        st["step"] += 1
        t = int(st["step"])
        gap = group["update_gap"]
        due = (t - 1) % gap == 0
        lr = group["lr"]
        projector = group["projector"]
        if projector not in ("none", "block") and p.dim() != 2:
            projector = "none"
        stateful = None  # full-space state-full update
        free_input = None
        if projector == "none":
            if "moment_step" not in st:
                self.zero_moments(group, st, g.shape)
            stateful = self.rule(group, st, g)
        elif projector == "block":
            pos, _ = self.where[p]
            n = len(group["params"])
            density = group["density"] if group["rank"] is None else min(1.0, group["rank"] / n)
            active = pos in P.active_blocks(n, density, (t - 1) // gap, group["block_order"], group["seed"])
            if active:
                if "moment_step" not in st or (due and t > 1 and group["on_refresh"] == "reset"):
                    self.zero_moments(group, st, g.shape)
                stateful = self.rule(group, st, g)
            else:
                for k in list(st):
                    if k != "step":
                        del st[k]
                free_input = g
        else:
            stateful, free_input = self.projected(group, p, st, g, t, due, projector)
        free = None
        if free_input is not None and group["free_rule"] != "none":
            free = torch.sign(free_input) if group["free_rule"] == "sign" else free_input
        if stateful is None and free is None:
            return
        p.mul_(1 - lr * group["weight_decay"])
        u = torch.zeros_like(g)
        if stateful is not None:
            u += stateful
        if free is not None:
            u += group["free_scale"] * free
        p.sub_(lr * u)

    def projected(self, group, p, st, g, t, due, projector):
        m, n = g.shape
        _, index = self.where[p]
        if projector in P.ORTHO_PROJECTORS:
            side = P.side_for(g.shape, group["proj_side"])
            dim = m if side == "left" else n
        else:
            side = None
            dim = n if projector == "columns" else m
        r = group["rank"] if group["rank"] is not None else int(round(group["density"] * dim))
        r = min(r, dim)
        if r == 0:
            return None, g
        key = "proj" if projector in P.ORTHO_PROJECTORS else "proj_index"
        if key not in st or due:
            gen = P.generator(p.device, group["seed"], index, (t - 1) // group["update_gap"])
            if projector == "svd":
                u, s, vh = torch.linalg.svd(g, full_matrices=False)
                new = u[:, :r] if side == "left" else vh[:r].T
            elif projector == "randomized_svd":
                new = P.randomized_basis(g, r, side, gen, group["oversample"], group["power_iters"])
            elif projector == "random":
                new = P.random_basis(dim, r, gen, g.device, g.dtype)
            else:
                new = P.random_coordinates(dim, r, gen, g.device)
            old = st.get(key)
            if old is not None and group["on_refresh"] == "reset":
                self.zero_moments(group, st, st[self.moments_of(group["rule"])[0]].shape)
            if old is not None and group["on_refresh"] == "project":
                for k in self.moments_of(group["rule"]):
                    st[k] = self.rotate(projector, side, old, new, st[k], k == "exp_avg_sq")
            st[key] = new.contiguous()
        basis = st[key]
        # projection as explicit matrices: Q for bases, a 0/1 selection matrix for coordinates
        if projector in P.ORTHO_PROJECTORS:
            q = basis
        else:
            q = torch.zeros(dim, r, dtype=g.dtype)
            q[basis, torch.arange(r)] = 1.0
        left = side == "left" or projector == "rows"
        low = q.T @ g if left else g @ q
        if "moment_step" not in st:
            self.zero_moments(group, st, low.shape)
        d = self.rule(group, st, low)
        back = q @ d if left else d @ q.T
        resid = torch.zeros_like(g) if r == dim else g - (q @ low if left else low @ q.T)  # exactly 0 at full rank
        return group["scale"] * back, resid

    @staticmethod
    def rotate(projector, side, old, new, mom, squared):
        if projector in P.ORTHO_PROJECTORS:
            rot = new.T @ old
            if squared:
                rot = rot ** 2
            return rot @ mom if side == "left" else mom @ rot.T
        out = torch.zeros_like(mom)
        for j_new, idx in enumerate(new.tolist()):
            hits = (old == idx).nonzero()
            if len(hits):
                j_old = int(hits[0])
                if projector == "columns":
                    out[:, j_new] = mom[:, j_old]
                else:
                    out[j_new, :] = mom[j_old, :]
        return out


def close(a, b, rtol=1e-5, atol=1e-7):
    return torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol) and math.isfinite(float(a.float().abs().sum()))
