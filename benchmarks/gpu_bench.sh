#!/usr/bin/env bash
# The GPU benchmark in one call: LLaMA-1B, bf16 weights, every slimopt method and every peer on one H200, plus the
# memory planner against torch.cuda.max_memory_allocated for a real training step at batch 8 x 512, then LLaMA-7B
# steps under a 16 GB cap, FSDP2 at one rank and int8 weights with a host master, after the CUDA step checks
# (benchmarks/gpu_step_checks.py). Fits one 9.5-minute run
# (each stage has its own time limit; methods left when the budget is spent get a "skipped" row).
#
# Prepare once, where PyPI is reachable (the GPU machine has no network):
#     bash benchmarks/fetch_wheels.sh            # -> .whl/ (git-ignored): bitsandbytes, torchao, galore-torch, apollo
# Run on the GPU machine, from the repository root (with the device tool: carry [".whl"], timeout_s 590):
#     bash benchmarks/gpu_bench.sh
# Results land in $OUT (default ./gpu-bench): step_checks.md and step_checks.json (benchmarks/gpu_step_checks.py),
# bench.md (tables, goals), bench.json, bench.png, memory-1b.md,
# llama7b.md and llama7b.json (LLaMA-7B under a 16 GB cap: benchmarks/llama7b_16gb.py), fsdp_step.json (FSDP2 at
# one rank against the whole model: benchmarks/fsdp_step.py), offload.md and offload.json (int8 weights with a
# host master: benchmarks/offload_gpu.py), env.txt, log.txt. Copy
# them into docs/benchmarks.md with the date and device they name.
# Then, as a second device call (its wheels fill what one call carries): torchtitan's Trainer with slimopt's
# methods on LLaMA-3 1B, benchmarks/torchtitan_gpu.sh (carry [".whl-torchtitan"], from fetch_wheels.sh --torchtitan).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-bench}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=/tmp/slimopt-peers

# 1. the peers, from the carried wheels (without them every peer row reads "not installed")
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || echo "installing the carried wheels failed: the peers will read 'not installed'"
else
    echo "no .whl/ folder: run benchmarks/fetch_wheels.sh first and carry .whl; the peers will read 'not installed'"
fi
# slimopt from the working tree, the peers from the wheels, everything else from the machine
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '| transformers', transformers.__version__)"
    python3 -c "import triton; print('triton', triton.__version__)" || echo "triton absent: CUDA steps run eagerly"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 2. what a CUDA step must do besides being fast: no host-device sync inside step(), a CUDA-graph capture equal
# to the eager step, CUDA against the CPU reference, kernel launches per step, every Triton fallback
timeout 90 python3 benchmarks/gpu_step_checks.py --out "$OUT" 2>&1 | tee -a "$OUT/log.txt"

# 3. every method's step, state and peak memory; the refresh timing; the planner against a real training step.
# The goals' methods first; then torch.compile'd variants (a compile per weight shape), the rest, and the
# full-SVD GaLore methods last (about 40 s per refresh of LLaMA-1B's 168 matrices).
METHODS=torch-adamw-fused,torch-adamw,adamw8bit,bnb-adamw8bit,frugal,frugal_rho0,taco,galore_rsvd,adamw
METHODS=$METHODS,adamw8bit+compile=true,adamw+compile=true,adamw4bit,ternary_adamw,frugal8bit,frugal_ternary
METHODS=$METHODS,badam,signsgd,apollo,apollo-mini,torchao-adamw8bit,torchao-adamw4bit,galore,galore8bit
METHODS=$METHODS,galore-torch,galore-torch-8bit
timeout 210 python3 -m slimopt bench --model 1b --device cuda --dtype bf16 --methods "$METHODS" \
    --steps 20 --warmup 3 --max-minutes 2 --check-planner --batch 8 --seq 512 --out "$OUT" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}

# 4. the planner's table for the same model and batch (seconds, no GPU work), next to the measurements
timeout 30 python3 -m slimopt memory --model 1b --method all --gpu-memory 139GiB --batch 8 --seq 512 \
    > "$OUT/memory-1b.md" 2>> "$OUT/log.txt"
# 5. LLaMA-7B under a 16 GB cap with the frugal_head recipe: measured peak against the plan, step time
timeout 120 python3 benchmarks/llama7b_16gb.py --out "$OUT" 2>&1 | tee -a "$OUT/log.txt"
status7b=${PIPESTATUS[0]}
# 6. the sharded route on the GPU: FSDP2 at one rank (nccl) against the whole model, LLaMA-1B, each step's time and
# CUDA kernels (benchmarks/fsdp_step.py)
timeout 60 python3 benchmarks/fsdp_step.py --device cuda --world 1 --model 1b --steps 11 \
    --methods adamw,adamw8bit,frugal,ternary_adamw --json "$OUT/fsdp_step.json" 2>&1 | tee -a "$OUT/log.txt"
# 7. int8 weights on the device with the master and the state on the host, against bf16 weights with the state on
# the device and int8 weights without a master: LLaMA-1B, the same 12 steps, peak memory, tokens/s, loss
# (benchmarks/offload_gpu.py)
timeout 60 python3 benchmarks/offload_gpu.py --steps 12 --out "$OUT" 2>&1 | tee -a "$OUT/log.txt"
echo "gpu_bench: slimopt bench exited with $status, the 7B run with $status7b; results in $OUT"
[ "$status" -eq 0 ] && exit "$status7b"
exit "$status"
