"""What Muon's Newton-Schulz iteration costs against an AdamW step, by matrix size (docs/benchmarks.md, "Muon").

For each square size n: the median time of ``slimopt.optim.algorithm.muon.orthogonalize`` (torch's 5 quintic steps) on an
n x n fp32 matrix, in fp32 and in bf16 (torch.optim.Muon's dtype), next to torch's fused AdamW step of one n x n
fp32 weight, on one thread. The iteration is ~15 n x n matmuls (30 n^3 flops), an AdamW step ~a dozen passes over
4 n^2 floats, so the ratio grows about linearly with n.

    python benchmarks/muon_ns_cost.py [--sizes 256,1024,2048] [--bf16-max 1024] [--reps 3]

bf16 runs only up to --bf16-max: on a CPU without bf16 matrix instructions a 2048 x 2048 bf16 iteration takes
minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from slimopt.optim.algorithm import muon


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _adamw_ms(n: int, reps: int) -> float:
    w = torch.nn.Parameter(torch.randn(n, n))
    w.grad = torch.randn(n, n)
    opt = torch.optim.AdamW([w], lr=1e-3, fused=True)
    return _median_ms(opt.step, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256,1024,2048")
    ap.add_argument("--bf16-max", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        u = torch.randn(n, n, generator=torch.Generator().manual_seed(n))
        fp32 = _median_ms(lambda: muon.orthogonalize(u, dtype=torch.float32), args.reps)
        bf16 = _median_ms(lambda: muon.orthogonalize(u, dtype=torch.bfloat16), 1) if n <= args.bf16_max else None
        adamw = _adamw_ms(n, args.reps)
        rows.append({"n": n, "ns_fp32_ms": fp32, "ns_bf16_ms": bf16, "adamw_fused_ms": adamw,
                     "fp32_x_adamw": fp32 / adamw, "gflops_fp32": 30 * n ** 3 / fp32 / 1e6})
    print("| n x n | NS fp32 ms | NS bf16 ms | torch fused AdamW step ms | NS fp32 / AdamW | fp32 GFLOP/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        bf16 = f"{r['ns_bf16_ms']:,.1f}" if r["ns_bf16_ms"] is not None else "-"
        print(f"| {r['n']} | {r['ns_fp32_ms']:,.1f} | {bf16} | {r['adamw_fused_ms']:,.2f} | "
              f"{r['fp32_x_adamw']:,.0f}x | {r['gflops_fp32']:.1f} |")
    print(json.dumps({"threads": args.threads, "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
