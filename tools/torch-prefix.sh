#!/usr/bin/env bash
# Prints LibTorch's CMake prefix from python3's torch package without importing torch (importing
# would load its CUDA libraries, which a machine without a GPU need not have).
python3 - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("torch")
print(os.path.join(os.path.dirname(spec.origin), "share", "cmake") if spec else "")
PY
