#!/usr/bin/env bash
# Build gpu-bundle/: what the GPU check (scripts/gpu_check.py) installs on a GPU machine that
# has no network. Its image has Python 3.12, torch (CUDA) and nvidia-ml-py; it lacks CRIU and
# torchpass's other dependencies. Carried with the working tree (the device tool's `carry`),
# so it must stay under 64 MiB.
#   wheels/   cp312 manylinux x86_64 wheels of torchpass's dependencies (pyproject.toml)
#   criu/     criu's .deb packages as this machine's apt has them, and root/: the criu binary and
#             the shared libraries it loads beyond glibc, to run with LD_LIBRARY_PATH where the
#             .debs do not install (another distribution or release)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_BUNDLE:-gpu-bundle}
PY=${PY:-.venv/bin/python}
LIMIT_MB=64
rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp/wheels" "$OUT.tmp/criu/root/bin" "$OUT.tmp/criu/root/lib"

# torchpass's runtime dependencies, read from pyproject.toml (one list, not a second copy here).
mapfile -t deps < <("$PY" - <<'EOF'
import tomllib
for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    print(d)
EOF
)
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_26_x86_64 -d "$OUT.tmp/wheels" "${deps[@]}"

criu_bin=$(command -v criu || echo /usr/sbin/criu)
[ -x "$criu_bin" ] || { echo "gpu-bundle: criu is not installed here (make deps)"; exit 1; }
(cd "$OUT.tmp/criu" && apt-get download criu libcompel1 libprotobuf-c1 libnet1 libnftables1 libnl-3-200 \
    >/dev/null 2>&1) || echo "gpu-bundle: apt-get download of criu's .debs failed; the binary and libraries are there"
cp "$criu_bin" "$OUT.tmp/criu/root/bin/criu"
ldd "$criu_bin" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
        libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*) ;;  # the image's glibc
        *) cp -L "$lib" "$OUT.tmp/criu/root/lib/" ;;
    esac
done
"$criu_bin" --version | head -1 > "$OUT.tmp/criu/VERSION"

mb=$(du -sm "$OUT.tmp" | cut -f1)
if [ "$mb" -gt "$LIMIT_MB" ]; then
    echo "gpu-bundle: ${mb} MiB, over the ${LIMIT_MB} MiB the working tree may carry"; exit 1
fi
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "gpu-bundle: $OUT, ${mb} MiB: $(ls "$OUT/wheels" | wc -l) wheels, $(cat "$OUT/criu/VERSION")"
