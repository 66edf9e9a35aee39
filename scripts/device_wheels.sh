#!/usr/bin/env bash
# The wheels a device run carries in the ignored .whl/ (what the device image lacks: scripts/device.sh installs them
# there): cp312 manylinux x86_64 builds, fetched with pip download --no-deps. About 25 MB of the 64 MiB a call carries.
#
#   bash scripts/device_wheels.sh                  # -> .whl/
#   WHL=DIR bash scripts/device_wheels.sh
#   bash scripts/device_wheels.sh --print-specs    # the requirement specs, one a line; nothing fetched
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# apache-tvm-ffi at pyproject.toml's pin; jsonschema and its dependencies; fla-core + einops (the fla peer and fla's
# backend tests); jax-tvm-ffi (the JAX tests); nvidia-cudnn-frontend 1.32.0 + cuda-bindings 13 + cuda-pathfinder (the
# cuDNN prefill peer, engine kda_hopper_cuda; nvidia-cutlass-dsl is not needed for it and too big to carry);
# pytest-xdist + execnet (tests/gpu in one device call: `pytest -n 8`)
tvm=$(python3 -c 'import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(d for d in deps if d.startswith("apache-tvm-ffi")))')
specs=("$tvm" "jax-tvm-ffi>=0.1.3" jsonschema attrs referencing rpds-py jsonschema-specifications typing_extensions
       "fla-core==0.6.0" einops "nvidia-cudnn-frontend==1.32.0" "cuda-bindings>=13,<14" cuda-pathfinder pytest-xdist execnet)
if [ "${1:-}" = "--print-specs" ]; then printf '%s\n' "${specs[@]}"; exit 0; fi
[ $# -eq 0 ] || { echo "device_wheels.sh takes no arguments but --print-specs (got: $*)" >&2; exit 2; }
dest=${WHL:-.whl}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --dest "$dest" --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${specs[@]}"
ls "$dest"/*.whl | sed 's|.*/||'
du -sh "$dest"
