#!/usr/bin/env bash
# GPU check of the profiler and the performance model on ONE CUDA GPU (see bench/gpu_check.py).
#
#   bash bench/gpu_check.sh                # on the GPU machine: profiles into $OUT/profiles/
#   bash bench/gpu_check.sh --cpu-dry-run  # anywhere: the same steps at toy sizes on the CPU
#   ADAPTIS_WHEELS=out/wheels bash bench/gpu_check.sh   # wheels from bench/fetch_gpu_wheels.sh, carried
#
# The GPU machine has no internet: it uses the torch installed there and this working tree
# through PYTHONPATH (no pip install: an editable install would fetch a build backend).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: '$PY -c \"import torch\"' fails: this machine needs torch >= 2.11" >&2
  exit 2
fi
missing=$("$PY" - <<'PYEOF'
import importlib.util
# module -> the distribution pip knows it by
wanted = {"pydantic": "pydantic", "yaml": "pyyaml", "numpy": "numpy"}
print(" ".join(dist for mod, dist in wanted.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ] && [ -n "${ADAPTIS_WHEELS:-}" ] && [ -d "$ADAPTIS_WHEELS" ]; then
  # Opt-in: wheels brought along at run time (never committed), installed into a scratch
  # directory, never into the machine's Python.
  site="$(mktemp -d)"
  "$PY" -m pip install -q --no-index --find-links "$ADAPTIS_WHEELS" --target "$site" $missing >&2
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  missing=""
fi
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python packages: $missing for $("$PY" -V 2>&1) (PyPI is not reachable here;" \
       "install them into the image, or bring wheels and set ADAPTIS_WHEELS=DIR)" >&2
  exit 2
fi
"$PY" -c 'import torch; print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"GPU {torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}")'
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" bench/gpu_check.py "$@"
