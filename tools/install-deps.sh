#!/usr/bin/env bash
# Installs what strata's build needs and a fresh Debian/Ubuntu machine lacks: compilers and build
# tools, clang for the fuzzer, Abseil, GoogleTest, Google Benchmark (Debian packages, with
# apt-get), LibTorch as the torch==2.11.0 Python package, and scikit-build-core, pytest, tqdm and numpy
# for the Python package (with pip). Does nothing when
# everything is there already.
set -euo pipefail

TORCH_VERSION=2.11.0
# clang and its runtime libraries build the libFuzzer target (`make fuzz`).
PACKAGES=(cmake ninja-build g++ ccache clang-format clang libclang-rt-14-dev python3 python3-pip
          python3-dev
          libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    # Tools that came from elsewhere (pyenv's python3, a newer cmake) count as present.
    case "$pkg" in
      python3) command -v python3 >/dev/null && continue ;;
      python3-pip) python3 -m pip --version >/dev/null 2>&1 && continue ;;
      # The Python extension needs python3's headers, wherever that python3 came from.
      python3-dev) python3 -c "import os, sysconfig; os.stat(os.path.join(
        sysconfig.get_paths()['include'], 'Python.h'))" 2>/dev/null && continue ;;
      cmake) command -v cmake >/dev/null && continue ;;
      clang-format) command -v clang-format >/dev/null && continue ;;
    esac
    missing+=("$pkg")
  fi
done
if ((${#missing[@]})); then
  echo "install-deps: installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

have_torch=$(python3 -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true)
if [ "${have_torch%%+*}" != "$TORCH_VERSION" ]; then
  echo "install-deps: installing torch==$TORCH_VERSION with pip (large download; used for its LibTorch)"
  if ! python3 -m pip install -q "torch==$TORCH_VERSION" 2>/tmp/strata-pip.err; then
    # Debian's system Python refuses pip installs unless told it may (PEP 668).
    python3 -m pip install -q --break-system-packages "torch==$TORCH_VERSION"
  fi
fi
# The Python package's build backend, its tests, the example's progress bar, and numpy, which
# torch.distributed.checkpoint needs (it pickles its plans through tensors).
for mod in scikit_build_core:scikit-build-core pytest:pytest tqdm:tqdm numpy:numpy; do
  if ! python3 -c "import ${mod%%:*}" 2>/dev/null; then
    echo "install-deps: installing ${mod#*:} with pip"
    tools/pip-install.sh python3 "${mod#*:}"
  fi
done
echo "install-deps: all dependencies present (torch $(python3 -c "import importlib.metadata as m; print(m.version('torch'))"))"
