"""FRUGAL's projected step with its one-pass residual write against the eager write, side by side on a CPU.

A projected step with a state-free residual (FRUGAL's svd, random, columns or rows projections) writes the weight
from the lifted direction L and the residual -up(low) + g. ``native.lift_update`` does it in one pass of the C
kernel; the eager write (``rules.apply_update``) makes the residual, its sign, the scaled sum and the decay as
tensors of their own. This times whole optimizer steps of the same optimizer on the same weights, the two writes
in alternation step by step, one torch thread, and prints each one's median and their ratio.

    python benchmarks/frugal_residual_write.py --model small --projector svd --steps 30
"""

import argparse
import statistics
import time

import torch

import slimopt
from slimopt.optim.routes.cpu import native
from slimopt.models.llama import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="a model config of slimopt.models.llama (default small)")
    ap.add_argument("--projector", default="svd", help="FRUGAL's projector: svd, random, columns or rows")
    ap.add_argument("--steps", type=int, default=30, help="timed steps of each write (default 30)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if native.library() is None:
        raise SystemExit("the C kernel cannot be built here (no C compiler)")
    model = build_model(args.model, 8192, 1, dtype=torch.bfloat16, seed=0, device=torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    # no refresh inside the timed steps; products in bf16 where the processor has bf16 units (the GaLore recipes')
    products = dict(proj_dtype="auto") if args.projector in ("svd", "random") else {}
    opt = slimopt.build(model, "frugal", projector=args.projector, update_gap=10 ** 6, **products)
    one_pass, eager = native.lift_applies, (lambda *a, **k: False)
    for _ in range(3):
        opt.step()
    times = {"one-pass write": [], "eager write": []}
    try:
        for _ in range(args.steps):
            for name in times:
                native.lift_applies = one_pass if name == "one-pass write" else eager
                t = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - t)
    finally:
        native.lift_applies = one_pass
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    for name, ms in med.items():
        print(f"{name}: {ms:.2f} ms a step (median of {args.steps})")
    print(f"frugal {args.projector} on {args.model}: one-pass / eager = {med['one-pass write'] / med['eager write']:.2f}")


if __name__ == "__main__":
    main()
