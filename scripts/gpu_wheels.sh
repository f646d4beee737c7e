#!/usr/bin/env bash
# Build the wheels the lent GPU machine lacks (scripts/gpu_wheels.txt) into one folder that travels
# with the run (it has no package index):
#   bash scripts/gpu_wheels.sh            # .gpu-wheels/, cp312 manylinux x86_64: the machine's Python 3.12
#   GPU_WHEELS_TARGET=local bash scripts/gpu_wheels.sh DIR   # for this interpreter (rehearsing the install here)
# then run(command="bash scripts/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=480).
# Binary wheels come from the index for the target; a package published only as an sdist (antlr4's
# runtime) is built here with `pip wheel` and must come out pure Python (py3-none-any).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.gpu-wheels}"
target="${GPU_WHEELS_TARGET:-image}"
max_mib="${GPU_WHEELS_MAX_MIB:-20}"
python="${PYTHON:-python3}"

case "$target" in
    image)
        tags=(--python-version 3.12 --implementation cp --abi cp312
              --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64) ;;
    local) tags=() ;;
    *) echo "GPU_WHEELS_TARGET=$target is unknown; choose image or local" >&2; exit 2 ;;
esac

rm -rf "$dir"
mkdir -p "$dir"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
grep -v '^\s*#' scripts/gpu_wheels.txt | sed 's/#.*//' | awk 'NF {print $1}' | while read -r spec; do
    if "$python" -m pip download -q --no-deps --only-binary=:all: "${tags[@]}" -d "$dir" "$spec" 2>"$build/err"; then
        continue
    fi
    # No wheel for the target: build one from the sdist; only a pure-Python wheel fits any target.
    "$python" -m pip wheel -q --no-deps --no-binary=:all: -w "$build" "$spec" >/dev/null
    name="${spec%%==*}"
    built=$(ls "$build"/*.whl 2>/dev/null | grep -i "/${name//-/_}-" || true)
    if [[ -z "$built" || "$built" != *-py3-none-any.whl && "$built" != *-py2.py3-none-any.whl ]]; then
        echo "gpu_wheels: $spec has no wheel for target $target and does not build as pure Python:" >&2
        cat "$build/err" >&2
        exit 1
    fi
    mv "$built" "$dir/"
done

count=$(ls "$dir"/*.whl | wc -l)
listed=$(grep -v '^\s*#' scripts/gpu_wheels.txt | awk 'NF' | wc -l)
if [[ "$count" -ne "$listed" ]]; then
    echo "gpu_wheels: $count wheels in $dir for $listed listed packages" >&2
    exit 1
fi
bytes=$(du -sb "$dir" | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "gpu_wheels: $count wheels, $mib MiB in $dir (target $target)"
if (( mib > max_mib )); then
    echo "gpu_wheels: $dir is $mib MiB, over $max_mib MiB (GPU_WHEELS_MAX_MIB): the working tree that travels is capped at 64 MiB" >&2
    exit 1
fi
