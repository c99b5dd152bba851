"""What a CUDA optimizer step must do beyond being fast, checked per method on a few LLaMA-1B-shaped bf16 tensors.

For each method: (1) ``step()`` under ``torch.cuda.set_sync_debug_mode("error")``: any host-device synchronization
inside it raises; (2) a CUDA-graph capture of one ``step()`` replayed against an eager step from the same weights,
gradients and state (equal, bit for bit, is the goal); (3) the CUDA step against the CPU eager reference from the
same start (bf16 weights within a few bf16 steps, codes mostly equal: torch's CUDA kernels contract products into
fma where its CPU ones do not); (4) CUDA kernel launches per step (torch's profiler) against the number of tensors,
and the host's time to issue a step (its Python and launches, and the gradients' copies, timed before
synchronizing) against the step's; and every Triton kernel that fell back to the eager step
(``triton_step.fallbacks()``). Writes step_checks.md and step_checks.json into --out. Needs a CUDA device; about a
minute on an H200.

    python benchmarks/gpu_step_checks.py --out gpu-bench
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
import traceback

import torch
from torch import nn

import slimopt
from slimopt.optim.routes.triton import triton_step

METHODS = ["adamw", "adamw8bit", "adamw4bit", "ternary_adamw", "frugal", "frugal_ternary", "taco", "galore",
           "lion8bit", "frugal_head"]  # frugal_head: the 7B recipe's stochastic-rounding weight write
SETTINGS = {"lion8bit": ("adamw", dict(rule="lion", state_bits=8, lr=1e-4))}


class Layer(nn.Module):
    """One LLaMA-1B layer's matrices (hidden 2048, MLP 5461) and a norm."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(2048, 2048, bias=False)
        self.up_proj = nn.Linear(2048, 5461, bias=False)
        self.down_proj = nn.Linear(5461, 2048, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(2048))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(8192, 2048)
        self.layers = nn.ModuleList([Layer()])
        self.lm_head = nn.Linear(2048, 8192, bias=False)


def build(method: str, model: nn.Module):
    base, extra = SETTINGS.get(method, (method, {}))
    return slimopt.build(model, base, **extra)


def make(device: str, seed: int = 0):
    """The model in bf16 on `device` and four steps of gradients (the same numbers on any device)."""
    torch.manual_seed(seed)
    model = Model().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed + 1)
    grads = [[(torch.randn(p.shape, generator=gen) * 1e-3).to(torch.bfloat16).to(device) for p in model.parameters()]
             for _ in range(4)]
    return model.to(device), grads


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def compare(a_params, b_params, a_opt, b_opt) -> dict:
    """The share of equal weights, the largest weight difference in bf16 steps at the tensor's largest weight,
    and the share of equal state entries."""
    worst, same_w, n_w, equal, total = 0.0, 0, 0, 0, 0
    for pa, pb in zip(a_params, b_params):
        x, y = pa.detach().float().cpu(), pb.detach().float().cpu()
        worst = max(worst, ((x - y).abs().max() / (torch.finfo(torch.bfloat16).eps * y.abs().max())).item())
        same_w += int((x == y).sum().item())
        n_w += x.numel()
        sa, sb = a_opt.state[pa], b_opt.state[pb]
        for k in sa:
            if k in sb and isinstance(sa[k], torch.Tensor) and sa[k].shape == sb[k].shape:
                equal += int((sa[k].detach().cpu() == sb[k].detach().cpu()).sum().item())
                total += sa[k].numel()
    return {"weights_equal_share": same_w / max(1, n_w), "max_weight_diff_bf16_steps": worst,
            "state_equal_share": equal / max(1, total)}


def check(method: str) -> dict:
    row: dict = {"method": method}
    model, grads = make("cuda")
    params = list(model.parameters())
    opt = build(method, model)
    set_grads(params, grads[0])
    opt.step()  # the state exists from here on (the first step of a subspace method also refreshes)
    torch.cuda.synchronize()

    # (1) no synchronization inside step()
    set_grads(params, grads[1])
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        opt.step()
        row["sync_free"] = "yes"
    except Exception as exc:
        row["sync_free"] = f"no: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    # (4) launches per step
    set_grads(params, grads[2])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    row["kernels_per_step"] = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    row["tensors"] = len(params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        set_grads(params, grads[3])
        opt.step()
    # before the synchronization: the host's time to issue a step (its Python, the launches), which bounds the
    # step wherever it exceeds the kernels' time
    row["host_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    torch.cuda.synchronize()
    row["step_ms"] = (time.perf_counter() - t0) / 5 * 1e3

    # (2) a captured step replayed equals an eager one from the same start
    try:
        twin_model = copy.deepcopy(model)
        twin_params = list(twin_model.parameters())
        twin = build(method, twin_model)
        twin.load_state_dict(copy.deepcopy(opt.state_dict()))
        set_grads(params, grads[1])
        set_grads(twin_params, grads[1])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph.replay()
        twin.step()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(params, twin_params))
        row["graph_replay"] = "equal" if same else f"differs ({compare(params, twin_params, opt, twin)})"
    except Exception as exc:
        row["graph_replay"] = f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"

    # (3) CUDA against the CPU eager reference, three steps from the same start
    cuda_model, g = make("cuda", seed=1)
    cpu_model, _ = make("cpu", seed=1)
    cuda_params, cpu_params = list(cuda_model.parameters()), list(cpu_model.parameters())
    cuda_opt, cpu_opt = build(method, cuda_model), build(method, cpu_model)
    for group in cpu_opt.param_groups:
        group["fused"] = False
    for step in range(3):
        set_grads(cuda_params, g[step])
        set_grads(cpu_params, [x.cpu() for x in g[step]])
        cuda_opt.step()
        cpu_opt.step()
    torch.cuda.synchronize()
    row["cuda_vs_cpu"] = compare(cuda_params, cpu_params, cuda_opt, cpu_opt)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-bench")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step_checks: no CUDA device")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for method in args.methods.split(","):
        try:
            rows.append(check(method))
        except Exception as exc:
            rows.append({"method": method, "error": f"{type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc()[-1500:]})
        print(json.dumps(rows[-1], default=str), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton_step.available(), "fallbacks": {str(k): v for k, v in triton_step.fallbacks().items()},
              "rows": rows}
    with open(os.path.join(args.out, "step_checks.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    lines = [f"## CUDA step checks ({report['device']}, torch {report['torch']}, triton "
             f"{'present' if report['triton'] else 'absent'})", "",
             "| method | step ms | host ms | kernels / step | tensors | sync-free | graph replay = eager | CUDA vs CPU: "
             "weights equal | largest difference (bf16 steps of the largest weight) | state entries equal |",
             "|---|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | error: {r['error'][:120]} | | | | | | | | |")
            continue
        c = r["cuda_vs_cpu"]
        lines.append(f"| {r['method']} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | {r['kernels_per_step']} | "
                     f"{r['tensors']} | "
                     f"{r['sync_free']} | {r['graph_replay']} | {c['weights_equal_share']:.4f} | "
                     f"{c['max_weight_diff_bf16_steps']:.2f} | "
                     f"{c['state_equal_share']:.4f} |")
    lines += ["", f"Triton fallbacks: {report['fallbacks'] or 'none'}"]
    with open(os.path.join(args.out, "step_checks.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
