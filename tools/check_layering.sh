#!/usr/bin/env bash
# Fails when an #include points the wrong way between strata's folders (each folder is a layer;
# includes point only downward; optim uses runtime/, never a policy directly) or when LibTorch
# headers appear outside bridge/, apps/, tests/ and bench/.
#   tools/check_layering.sh [ROOT]      check the tree at ROOT (default: the repository)
#   tools/check_layering.sh --self-test check that the checker catches planted violations
set -euo pipefail

allowed() {  # the folders a layer may include from
  case "$1" in
    base) echo "base" ;;
    allocator) echo "base allocator" ;;
    runtime) echo "base allocator runtime" ;;
    policies) echo "base allocator runtime policies" ;;
    optim) echo "base allocator runtime optim" ;;
    bridge) echo "base allocator runtime policies optim bridge" ;;
    apps) echo "base allocator runtime policies optim bridge apps" ;;
  esac
}
LAYERS="base allocator runtime policies optim bridge apps"
TORCH_OK="bridge apps tests bench"

check_tree() {
  local root=$1 bad=0 layer file line inc top
  for layer in $LAYERS tests bench; do
    [ -d "$root/$layer" ] || continue
    while IFS= read -r file; do
      while IFS= read -r line; do
        inc=$(sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]([^>"]+)[>"].*/\1/' <<<"$line")
        top=${inc%%/*}
        if [[ " $LAYERS " == *" $top "* ]] && [[ " tests bench " != *" $layer "* ]]; then
          if [[ " $(allowed "$layer") " != *" $top "* ]]; then
            echo "layering: ${file#"$root"/}: '$layer' may not include '$inc'"
            bad=1
          fi
        fi
        if [[ "$top" =~ ^(torch|ATen|c10|caffe2)$ ]] && [[ " $TORCH_OK " != *" $layer "* ]]; then
          echo "layering: ${file#"$root"/}: LibTorch header '$inc' outside bridge/, apps/, tests/, bench/"
          bad=1
        fi
      done < <(grep -E '^[[:space:]]*#[[:space:]]*include' "$file" || true)
    done < <(find "$root/$layer" -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \))
  done
  return $bad
}

if [ "${1:-}" = "--self-test" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/allocator" "$tmp/runtime" "$tmp/optim" "$tmp/policies"
  echo '#include "allocator/tier.h"' >"$tmp/runtime/ok.h"
  check_tree "$tmp" >/dev/null || { echo "self-test: a clean tree was rejected"; exit 1; }
  for planted in 'allocator/up.h:#include "runtime/registry.h"' \
                 'optim/adam.h:#include "policies/bulk.h"' \
                 'allocator/t.cpp:#include <torch/torch.h>'; do
    file=${planted%%:*}
    echo "${planted#*:}" >"$tmp/$file"
    if check_tree "$tmp" >/dev/null; then echo "self-test: missed ${planted}"; exit 1; fi
    rm "$tmp/$file"
  done
  echo "check_layering self-test: 3 planted violations caught"
  exit 0
fi

root=$(cd "${1:-$(dirname "$0")/..}" && pwd)
if check_tree "$root"; then
  echo "check_layering: includes point downward only"
else
  exit 1
fi
