# Sourced by the tools/gpu scripts: `gpu_build LOG_DIR [TARGET...]` unpacks the Debian packages
# that tools/gpu/fetch-debs.sh put in .deps/debs, configures a Release build in $BUILD with CUDA
# (arch 90) and python3's LibTorch, and builds the targets (everything without any). Run from the
# repository root. Returns non-zero, with the first errors printed, if any step fails.
BUILD=/tmp/strata-build

# The GPU's name, memory and driver, and the host's cores, into LOG_DIR/gpu.txt (and printed).
gpu_info() {
  mkdir -p "$1"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$1/gpu.txt"
  nproc >>"$1/gpu.txt"
}

# The base of an A/B: a copy of the working tree (but .deps, linked) in /tmp/strata-base with
# PATCH reversed. Run from the repository root.
base_tree() {
  local base=/tmp/strata-base
  rm -rf "$base" && mkdir -p "$base"
  tar cf - --exclude=./.deps . | tar xf - -C "$base"
  ln -s "$PWD/.deps" "$base/.deps"
  (cd "$base" && { git apply -R "$1" || patch -s -R -p1 <"$1"; })
}

gpu_build() {
  local logs=$1; shift
  if ! ls .deps/debs/*.deb >/dev/null 2>&1; then
    echo "no .deps/debs: run tools/gpu/fetch-debs.sh where a registry is reachable, and carry .deps"
    return 2
  fi
  mkdir -p /tmp/deps "$logs"
  for f in .deps/debs/*.deb; do dpkg -x "$f" /tmp/deps; done
  export LD_LIBRARY_PATH=/tmp/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DSTRATA_PYTHON="$(python3 -c "import os, sysconfig; print('ON' if os.path.exists(os.path.join(
      sysconfig.get_paths()['include'], 'Python.h')) else 'OFF')")" \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
    -DCMAKE_PREFIX_PATH="$(tools/torch-prefix.sh);/tmp/deps/usr" >"$logs/configure.log" 2>&1 \
    || { tail -40 "$logs/configure.log"; return 1; }
  local targets=()
  (($#)) && targets=(--target "$@")
  cmake --build "$BUILD" "${targets[@]}" >"$logs/build.log" 2>&1 \
    || { grep -E "error|FAILED" "$logs/build.log" | head -40; return 1; }
}

# The strata package assembled in /tmp/strata-pkg from python/strata and the built module (the GPU
# machine has no registry for pip's build backend), on PYTHONPATH; pytest, tqdm and numpy from the
# wheels in .deps/wheels (tools/gpu/fetch-debs.sh) where the python lacks them.
python_package() {
  local pkg=/tmp/strata-pkg
  rm -rf "$pkg" && mkdir -p "$pkg/strata"
  cp python/strata/*.py "$pkg/strata/" && cp "$BUILD"/python/strata/_strata*.so "$pkg/strata/" ||
    return 1
  local want=()
  for mod in pytest tqdm numpy; do python3 -c "import $mod" 2>/dev/null || want+=("$mod"); done
  if ((${#want[@]})); then
    python3 -m pip install -q --no-index --find-links .deps/wheels "${want[@]}" 2>/dev/null ||
      python3 -m pip install -q --break-system-packages --no-index --find-links .deps/wheels \
        "${want[@]}"
  fi
  export PYTHONPATH=$pkg
}

# What the Python runs begin with: the module built, the package on PYTHONPATH, and the GPU's name
# and the machine's cores written to LOG_DIR/gpu.txt and cpus.txt.
python_setup() {
  local logs=$1
  gpu_build "$logs" _strata || return 1
  python_package || return 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$logs/gpu.txt"
  nproc >"$logs/cpus.txt"
}

# torchao (bench/users_script.py's CPUOffloadOptimizer peer) from .deps/wheels, unless python3
# has it.
install_torchao() {
  python3 -c "import torchao" 2>/dev/null ||
    python3 -m pip install -q --no-deps --no-index --find-links .deps/wheels torchao 2>/dev/null ||
    python3 -m pip install -q --break-system-packages --no-deps --no-index \
      --find-links .deps/wheels torchao
}

# Packs everything in LOG_DIR but gpu.txt and summary.txt into LOG_DIR/all.tgz, since a device call
# returns 8 files at most: a script that writes more calls it last (`tar xzf all.tgz` here).
pack_out() {
  local logs=$1
  (cd "$logs" && tar czf ../all.tgz --exclude=gpu.txt --exclude=summary.txt . &&
    find . -mindepth 1 ! -name gpu.txt ! -name summary.txt -delete && mv ../all.tgz .)
}
