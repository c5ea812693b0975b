#!/usr/bin/env bash
# pip install into the given python, as install-deps does: Debian's system Python refuses pip
# installs unless told it may (PEP 668).
#   tools/pip-install.sh PYTHON ARGS...
set -euo pipefail
py=$1
shift
if ! "$py" -m pip install -q "$@" 2>/tmp/strata-pip.err; then
  if grep -q externally-managed /tmp/strata-pip.err; then
    "$py" -m pip install -q --break-system-packages "$@"
  else
    cat /tmp/strata-pip.err >&2
    exit 1
  fi
fi
