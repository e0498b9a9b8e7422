#!/usr/bin/env bash
# The checks that need CUDA, in one call on a machine with a GPU (the device tool's):
#   bash tests/gpu/run.sh [pytest args]     # from anywhere; TIMEOUT_S (300) bounds the run
# The log goes to $OUT/gpu-tests.log ($OUT: the folder the device tool brings back; else /tmp).
# Exits 3 when no GPU is visible (the tests would all skip: nothing checked), else pytest's code.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
LOG="${OUT:-/tmp}/gpu-tests.log"
if ! $PY -c "import sys, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'gpus', torch.cuda.device_count()); sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "tests/gpu: no CUDA GPU visible to torch: nothing to check here" >&2
    exit 3
fi
timeout "${TIMEOUT_S:-300}" $PY -m pytest -p no:cacheprovider -rs tests/gpu "$@" 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
