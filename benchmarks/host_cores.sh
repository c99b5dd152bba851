#!/usr/bin/env bash
# The device machine's host processor in one call, no GPU work: the optimizer's host step on many cores, where
# torch's fused AdamW (14 bytes a parameter on bf16 weights) meets the memory's bandwidth before the compressed
# steps (6-10 bytes) do, which a 2-core machine cannot show (issue 47's bar, issue 46's offloaded layer), and
# FSDP2's per-rank step with more cores than ranks.
#   1. benchmarks/host_step.py at 1, 8 and all threads (one LLaMA-7B MLP pair and attention projection, 107M)
#   2. benchmarks/offload_step.py at all threads (one LLaMA-7B layer, int8 weights with fp32 masters, 202M), GaLore's
#      row in a run of its own
#   3. benchmarks/fsdp_step.py --world 2 (two gloo ranks on the small LLaMA)
# Fits one 7-minute call; each stage has its own time limit. Run from the repository root (device tool: no carry,
# timeout_s 480):
#     bash benchmarks/host_cores.sh
# Results land in $OUT (default ./host-cores): env.txt, host_step.json/.md, offload_step.json/.md,
# offload_step_galore.json/.md, fsdp_step.json/.md, log.txt. Copy them into docs/benchmarks.md with the date and
# processor they name.
# THREADS (default "1,8,<all>") overrides the host step's thread counts.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/host-cores}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
CORES=$(nproc)
THREADS="${THREADS:-$(printf '%s\n' 1 8 "$CORES" | awk -v n="$CORES" '$1 <= n' | sort -nu | paste -sd,)}"

{
    date -u
    lscpu | grep -E "^(Model name|Socket|Core|Thread|NUMA node\(s\)|L3)" || true
    grep MemTotal /proc/meminfo
    python3 -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__)"
    echo "threads: $THREADS"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout 150 python3 benchmarks/host_step.py --threads "$THREADS" --rounds 1 --steps 3 --out "$OUT/host_step.json" \
    2>&1 | tee "$OUT/host_step.md" | tee -a "$OUT/log.txt"
host=${PIPESTATUS[0]}
timeout 100 python3 benchmarks/offload_step.py --threads "$CORES" --steps 3 --methods adamw,adamw8bit,ternary_adamw \
    --out "$OUT/offload_step.json" 2>&1 | tee "$OUT/offload_step.md" | tee -a "$OUT/log.txt"
offload=${PIPESTATUS[0]}
# GaLore's host step is its projections' matrix products (seconds a layer on two cores): its own run and limit
timeout 90 python3 benchmarks/offload_step.py --threads "$CORES" --steps 2 --methods galore8bit \
    --out "$OUT/offload_step_galore.json" 2>&1 | tee "$OUT/offload_step_galore.md" | tee -a "$OUT/log.txt"
timeout 90 python3 benchmarks/fsdp_step.py --world 2 --steps 15 --json "$OUT/fsdp_step.json" \
    2>&1 | tee "$OUT/fsdp_step.md" | tee -a "$OUT/log.txt"
fsdp=${PIPESTATUS[0]}
echo "host_cores: host_step exited with $host, offload_step with $offload, fsdp_step with $fsdp; results in $OUT"
[ "$host" -eq 0 ] && [ "$offload" -eq 0 ] && [ "$fsdp" -eq 0 ]
