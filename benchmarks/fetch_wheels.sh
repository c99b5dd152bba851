#!/usr/bin/env bash
# Fetch the peer libraries as wheels into .whl/ (git-ignored) for the GPU machine, which has no network and lacks
# bitsandbytes, torchao, galore-torch and apollo-torch (DESIGN.md section 7). Run once on a machine with PyPI
# access, from the repository root:
#
#     bash benchmarks/fetch_wheels.sh
#
# The GPU machine runs Python 3.12 with torch 2.11 + CUDA 13.0. bitsandbytes ships CUDA libraries for every CUDA
# version (43 MB); only the CUDA 13.0 and CPU ones are kept (~4 MB), so the wheels travel well within the 64 MiB
# a device call carries. benchmarks/gpu_bench.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
# Pinned to the versions the peers were checked against here (tests/test_planner.py, tests/test_bench.py).
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl bitsandbytes==0.50.2 torchao==0.18.0 galore-torch==1.0 apollo-torch==1.0.3

python3 - <<'EOF'
"""Keep only bitsandbytes' CPU and CUDA 13.0 libraries; drop the others from the archive and its RECORD."""
import glob
import os
import re
import zipfile

keep = re.compile(r"libbitsandbytes_(cpu|cuda130)\.so$")
for path in glob.glob(".whl/bitsandbytes-*.whl"):
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            name = info.filename
            if "libbitsandbytes_" in name and name.endswith(".so") and not keep.search(name):
                continue
            data = src.read(name)
            if name.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(l for l in lines
                                  if not ("libbitsandbytes_" in l and ".so," in l and not keep.search(l.split(",")[0])))
                        + "\n").encode()
            dst.writestr(info, data)
    os.replace(tmp, path)
    print(f"{path}: {os.path.getsize(path) / 2**20:.1f} MiB")
EOF
ls -la .whl
