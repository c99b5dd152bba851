#!/usr/bin/env bash
# Fetch wheels for the GPU machine, which has no network. Run once on a machine with PyPI
# access, from the repository root:
#
#     bash benchmarks/fetch_wheels.sh                # -> .whl/: the peers (bitsandbytes, torchao, galore-torch,
#                                                    #    apollo-torch) for benchmarks/gpu_bench.sh
#     bash benchmarks/fetch_wheels.sh --torchtitan   # -> .whl-torchtitan/: torchtitan 0.3.0 and what it imports that
#                                                    #    the GPU machine lacks (datasets, pyarrow, pandas, tyro, ...),
#                                                    #    plus assets/ (tokenizer, KJV text) for benchmarks/torchtitan_gpu.sh
#
# The GPU machine runs Python 3.12 with torch 2.11 + CUDA 13.0. A device call carries 64 MiB with the working tree,
# so libraries the runs never load are cut from the big wheels: bitsandbytes keeps its CUDA 13.0 and CPU libraries
# (43 -> ~4 MB); pyarrow drops Flight, its tests and C++ sources (43 -> ~31 MB). Both folders are
# git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
download() {  # FOLDER, then requirements
    local folder=$1
    shift
    mkdir -p "$folder"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$folder" "$@"
}

if [ "${1:-}" = "--torchtitan" ]; then
    FOLDER=.whl-torchtitan
    # torchtitan's pins (datasets < 4.8; dill and multiprocess as datasets 4.7 pins them), tyro's and tensorboard's
    # pure-Python dependencies; torch, transformers, huggingface-hub, numpy, requests, httpx are on the machine
    download "$FOLDER" torchtitan==0.3.0 torchdata==0.11.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 \
        tyro==1.0.17 docstring-parser typeguard shtab einops tensorboard==2.21.0 tensorboard-data-server \
        datasets==4.7.0 pyarrow==21.0.0 pandas==2.2.3 "dill==0.4.0" "multiprocess==0.70.18" xxhash "fsspec==2026.2.0" \
        python-dateutil tzdata pytz
    rm -rf "$FOLDER/assets"
    PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m slimopt.integrations.text_assets --data kjv \
        --max-chars 2000000 --out "$FOLDER/assets"  # 2M characters: ~500k tokens, 30 steps of 8 x 2048
else
    FOLDER=.whl
    # Pinned to the versions the peers were checked against here (tests/test_planner.py, tests/test_bench.py).
    download "$FOLDER" bitsandbytes==0.50.2 torchao==0.18.0 galore-torch==1.0 apollo-torch==1.0.3
fi

python3 - "$FOLDER" <<'PY'
"""Cut the files the GPU runs never load from the big wheels, from the archive and from its RECORD."""
import glob
import os
import re
import sys
import zipfile

DROP = {  # wheel name prefix -> what to leave out
    "bitsandbytes-": re.compile(r"libbitsandbytes_(?!cpu\.so$|cuda130\.so$)[^/]*\.so$"),
    # pyarrow's core libraries link Substrait, not Flight (checked: pyarrow 21 without Flight imports, and datasets
    # loads a JSON-lines folder with it)
    "pyarrow-": re.compile(r"(libarrow_flight|_flight\.|/tests/|\.pyx$|\.pxd$|\.pxi$|\.h$|\.cc$|/include/)"),
}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    drop = next((rx for prefix, rx in DROP.items() if os.path.basename(path).startswith(prefix)), None)
    if drop is None:
        continue
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            name = info.filename
            if drop.search(name):
                continue
            data = src.read(name)
            if name.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not drop.search(line.split(",")[0])]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data)
    os.replace(tmp, path)
    print(f"{path}: {os.path.getsize(path) / 2**20:.1f} MiB")
PY
du -sh "$FOLDER"
