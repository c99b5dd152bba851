#!/usr/bin/env bash
# Compile every Triton kernel specialization that slimopt's steps launch, for a GPU target, with another triton
# than the one installed: by default 3.6.0, what the GPU machine ships. No GPU is needed:
# triton's compiler and its bundled ptxas run on a CPU. tests/test_triton.py does the same with the installed triton
# in every test run; this is for the version a GPU will actually compile with.
#
#     bash benchmarks/triton_compile_check.sh [VERSION] [ARCH]     # defaults: 3.6.0 90 (an H200)
#
# It downloads that triton's wheel from PyPI into a cache folder (about 190 MB), records the specializations with
# the installed triton's interpreter (tests/triton_worker.py), compiles them with the other one in a separate
# process and prints how many compiled and each failure's innermost error. Exit status 1 when any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-3.6.0}"
ARCH="${2:-90}"
DIR="${SLIMOPT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/slimopt}/triton-$VERSION"
if [ ! -d "$DIR/site/triton" ]; then
    mkdir -p "$DIR"
    python3 -m pip download -q --no-deps "triton==$VERSION" -d "$DIR/wheel"
    python3 -m pip install -q --no-deps --target "$DIR/site" "$DIR"/wheel/triton-*.whl
fi
SPECS="$(mktemp)"
TRITON_INTERPRET=1 SLIMOPT_TRITON_CPU=1 OMP_NUM_THREADS=1 python3 - "$SPECS" <<'EOF'
import json, subprocess, sys
res = subprocess.run([sys.executable, "tests/triton_worker.py"], capture_output=True, text=True, check=True)
specs = json.loads(res.stdout.strip().splitlines()[-1])["specializations"]
json.dump(specs, open(sys.argv[1], "w"))
print(f"{len(specs)} specializations recorded")
EOF
REPORT="$(mktemp)"
trap 'rm -f "$SPECS" "$REPORT"' EXIT
env -u TRITON_INTERPRET -u SLIMOPT_TRITON_CPU PYTHONPATH="$DIR/site:$PWD/src" TRITON_CACHE_DIR="$DIR/cache" \
    SLIMOPT_COMPILE_ARCH="$ARCH" python3 tests/triton_compile_worker.py < "$SPECS" > "$REPORT"
python3 - "$REPORT" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"triton {r['triton']}, {r['target']}: {len(r['compiled'])} compiled, {len(r['failed'])} failed")
for label, why in r["failed"].items():
    print(f"- {label}\n    {why}")
sys.exit(1 if r["failed"] else 0)
EOF
