#!/usr/bin/env bash
# slimopt inside torchtitan on one GPU: LLaMA-3 1B (torchtitan's model, FSDP2 at one rank, bf16 compute), torch's
# fused AdamW (torchtitan's default optimizer) against slimopt's methods through slimopt.integrations.torchtitan;
# tokens/s, peak reserved memory and loss from torchtitan's own log, 30 steps each on KJV text.
#
# torchtitan imports `datasets` (pyarrow, pandas), which the GPU machine lacks, and with the peers' wheels they pass
# the 64 MiB a device call carries: so this is a second device call after benchmarks/gpu_bench.sh.
# Prepare once, where PyPI is reachable (writes .whl-torchtitan/: wheels and assets/, git-ignored):
#     bash benchmarks/fetch_wheels.sh --torchtitan
# Run on the GPU machine, from the repository root (device tool: carry [".whl-torchtitan"], timeout_s 420):
#     bash benchmarks/torchtitan_gpu.sh
# Results land in $OUT (default ./gpu-bench): torchtitan.md and torchtitan.json (benchmarks/torchtitan_report.py),
# torchtitan/<run>.log. Copy them into docs/distributed.md with the date and device they name.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-bench}"
CARRY=.whl-torchtitan
SITE=/tmp/slimopt-torchtitan
STEPS="${STEPS:-30}"
mkdir -p "$OUT/torchtitan"
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

if ! compgen -G "$CARRY/*.whl" > /dev/null || [ ! -d "$CARRY/assets" ]; then
    echo "no $CARRY/ wheels or assets: run benchmarks/fetch_wheels.sh --torchtitan first and carry $CARRY"
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY"/*.whl \
    || { echo "installing the carried torchtitan wheels failed"; exit 2; }
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"

run() {  # NAME, then torchtitan.train options
    local name=$1
    shift
    timeout 150 python3 -m torch.distributed.run --nproc_per_node 1 --master_addr 127.0.0.1 --master_port 29555 \
        -m torchtitan.train --module slimopt.integrations.torchtitan "$@" \
        --hf-assets-path "$CARRY/assets/tokenizer" --dataloader.dataset c4_test \
        --dataloader.dataset-path "$CARRY/assets/text" --training.steps "$STEPS" --training.local-batch-size 8 \
        --training.seq-len 2048 --metrics.log-freq 5 --dump-folder "$OUT/torchtitan/$name" \
        > "$OUT/torchtitan/$name.log" 2>&1
    echo "torchtitan $name: exit $? ($(grep -c 'step:' "$OUT/torchtitan/$name.log") logged steps)"
}

run torch-adamw --config llama3_1b_adamw
run adamw --config llama3_1b_slimopt --optimizer.method adamw
run adamw8bit --config llama3_1b_slimopt --optimizer.method adamw8bit
run frugal --config llama3_1b_slimopt
run taco --config llama3_1b_slimopt --optimizer.method taco
python3 benchmarks/torchtitan_report.py "$OUT/torchtitan" --md "$OUT/torchtitan.md" --json "$OUT/torchtitan.json"
