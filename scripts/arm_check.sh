#!/usr/bin/env bash
# The C kernels' tests on 64-bit ARM, on an x86 Debian 12 machine (as root), under qemu's user-mode
# emulation: Debian's arm64 Python 3.11, the aarch64 wheels of torch and the test dependencies, the
# aarch64 cross compiler as the kernels' compiler (CC), and pytest run by qemu-aarch64. The kernels
# are then built the way attentions/ops/native.py builds them on an ARM machine (8 floats of plain C
# vectors, NEON) and the reference-vs-fast tests run them.
#
#   bash scripts/arm_check.sh                        # torch 2.7.1, the kernel tests
#   bash scripts/arm_check.sh 2.7.1 tests/test_mita_cpu.py
#   bash scripts/arm_check.sh --setup                # only the environment (CI, before pytest)
#
# The first argument is the torch version (default 2.7.1: PyPI's aarch64 wheels of later versions
# are CUDA builds that do not import without CUDA's libraries); the rest are pytest's (default: the
# kernel tests of tests/test_kernel_widths.py that compare results, all but tests/test_ops.py, whose
# opchecks test the operators' registration, the same on every machine, and take half the time under
# qemu). The environment is kept in $ARM_CHECK_DIR (default ~/.cache/lra-suite/arm, about 700 MB);
# setting it up takes about 2 minutes, the tests about 2 (tests/test_kernel_arm.py runs them when it
# is there).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
setup_only=0
if [ "${1:-}" = "--setup" ]; then setup_only=1; shift; fi
torch_version=${1:-2.7.1}
shift $(( $# > 0 ? 1 : 0 ))
dir=${ARM_CHECK_DIR:-$HOME/.cache/lra-suite/arm}
sysroot=$dir/sysroot site=$dir/site-$torch_version

if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null \
        || ! dpkg --print-foreign-architectures | grep -qx arm64; then
    dpkg --add-architecture arm64
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu libgomp1-arm64-cross \
        >/dev/null
fi

# Debian's arm64 Python and the libraries it and torch load, unpacked into a root that qemu reads
# its dynamic loader and libraries from (-L)
if [ ! -x "$sysroot/usr/bin/python3.11" ]; then
    debs=$(mktemp -d)
    (cd "$debs" && apt-get download -qq -o APT::Sandbox::User=root \
        python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 libc6:arm64 \
        libexpat1:arm64 zlib1g:arm64 libffi8:arm64 libssl3:arm64 libbz2-1.0:arm64 liblzma5:arm64 \
        libsqlite3-0:arm64 libncursesw6:arm64 libtinfo6:arm64 libreadline8:arm64 libuuid1:arm64 \
        libcrypt1:arm64 libgcc-s1:arm64 libstdc++6:arm64 libgomp1:arm64 libdb5.3:arm64 libgdbm6:arm64 \
        libnsl2:arm64 libtirpc3:arm64 libgssapi-krb5-2:arm64 libkrb5-3:arm64 libk5crypto3:arm64 \
        libcom-err2:arm64 libkrb5support0:arm64 libkeyutils1:arm64)
    mkdir -p "$sysroot.partial"
    for deb in "$debs"/*.deb; do dpkg -x "$deb" "$sysroot.partial"; done
    rm -rf "$debs" "$sysroot"
    mv "$sysroot.partial" "$sysroot"
fi

# torch, numpy and what the tests import, as aarch64 wheels (pure-Python ones as they are)
if [ ! -d "$site/torch" ]; then
    rm -rf "$site.partial"
    python -m pip install --quiet --disable-pip-version-check --no-deps --target "$site.partial" \
        --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux_2_28_aarch64 \
        --python-version 3.11 --implementation cp --abi cp311 --only-binary=:all: \
        "torch==$torch_version" numpy pyyaml markupsafe typing_extensions sympy mpmath networkx jinja2 \
        filelock fsspec tqdm submitit cloudpickle pytest pluggy iniconfig packaging pygments
    rm -rf "$site"
    mv "$site.partial" "$site"
fi

[ "$setup_only" = 1 ] && exit 0
if [ $# -eq 0 ]; then
    set -- $(python -c "import sys; sys.path.insert(0, 'tests'); from test_kernel_widths import KERNEL_TESTS; \
print(*(path for path in KERNEL_TESTS if path != 'tests/test_ops.py'))")
fi

run() {
    CC=aarch64-linux-gnu-gcc LRA_KERNEL_CACHE="$dir/kernels" PYTHONPATH="$repo:$site" TRITON_INTERPRET=0 \
        qemu-aarch64 -L "$sysroot" "$sysroot/usr/bin/python3.11" "$@"
}
# what runs (machine, torch, the kernels' width and compiler), then pytest, in one process
run -c "import platform, sys, pytest, torch; from attentions.ops import native; \
print(platform.machine(), 'torch', torch.__version__, '| kernels', native.vector_width('grouped_cpu'), \
'floats wide,', 'built with', native.compiler(), flush=True); \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))" "$@"
