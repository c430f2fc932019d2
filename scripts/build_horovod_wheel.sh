#!/usr/bin/env bash
# Build the Horovod wheel that `make test-horovod` installs, once, into a cache outside the
# repository, so later runs of the lane only install it.
#
# Usage: scripts/build_horovod_wheel.sh PYTHON [WHEEL_DIR]
#   PYTHON     a Python whose environment already has the pinned torch installed
#              (the extension is compiled against it, without build isolation).
#   WHEEL_DIR  where the wheel is cached (default: ~/.cache/accord/wheels).
#
# Why a patched sdist: horovod 0.28.1's CMake asks for C++14, and the headers of the
# torch this project pins need C++17. The build uses gloo on CPU: no MPI, TensorFlow or
# MXNet. Set MAKEFLAGS (e.g. -j1) to limit the parallel compile jobs.
set -euo pipefail

PYTHON=${1:?usage: $0 PYTHON [WHEEL_DIR]}
WHEEL_DIR=${2:-"$HOME/.cache/accord/wheels"}
VERSION=${HOROVOD_VERSION:-0.28.1}

shopt -s nullglob
cached=("$WHEEL_DIR"/horovod-"$VERSION"-*.whl)
if ((${#cached[@]})); then
    echo "build_horovod_wheel: using cached ${cached[0]}"
    exit 0
fi

if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    echo "build_horovod_wheel: $PYTHON cannot import torch; install the pinned torch first." >&2
    exit 1
fi
if ! command -v "${HOROVOD_CMAKE:-cmake}" >/dev/null; then
    echo "build_horovod_wheel: cmake (>= 3.13) is needed to build horovod." >&2
    exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m pip install -q setuptools wheel
"$PYTHON" -m pip download -q --no-binary :all: --no-deps "horovod==$VERSION" -d "$work"
tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
src="$work/horovod-$VERSION"

for file in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$file"
    if grep -q 'set(CMAKE_CXX_STANDARD 14)' "$file"; then
        echo "build_horovod_wheel: could not patch the C++ standard in $file" >&2
        exit 1
    fi
done

echo "build_horovod_wheel: compiling horovod $VERSION (gloo, PyTorch); this takes minutes."
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    MAKEFLAGS=${MAKEFLAGS:-"-j$(nproc)"} \
    "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w "$work/dist" "$src"

built=("$work"/dist/horovod-"$VERSION"-*.whl)
if ((${#built[@]} != 1)); then
    echo "build_horovod_wheel: expected one wheel in $work/dist" >&2
    exit 1
fi
mkdir -p "$WHEEL_DIR"
# Copy under a temporary name, then rename: a run interrupted here leaves no partial wheel.
name=$(basename "${built[0]}")
cp "${built[0]}" "$WHEEL_DIR/.$name.partial"
mv "$WHEEL_DIR/.$name.partial" "$WHEEL_DIR/$name"
echo "build_horovod_wheel: cached $WHEEL_DIR/$name"
