#!/usr/bin/env bash
# Set up everything AdaPtis needs on a fresh machine, idempotently:
#   - a Python virtual environment shared by every clone (torch is several GB: install once),
#     at $ADAPTIS_VENV (default ~/.cache/adaptis/venv), with this checkout installed editable;
#   - with --test: the real Kubernetes control plane and node binaries and Prometheus (hack/);
#   - the `adaptis` command linked into ~/.local/bin (scripts/link-cli.sh), with a hint when
#     that directory is not on PATH.
# Prints the venv's bin directory on its last line (the only line on stdout; messages go to
# stderr).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ADAPTIS_VENV:-$HOME/.cache/adaptis/venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating virtual environment $VENV" >&2
  "$PY" -m venv "$VENV"
fi
# Reinstall only when the dependency declarations changed.
stamp="$VENV/.adaptis-deps-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing Python dependencies (first time: torch, a few minutes)" >&2
  "$VENV/bin/pip" install -q --upgrade pip >&2
  "$VENV/bin/pip" install -q -c constraints.txt -e ".[dev,worker,operator,timeline]" >&2
  rm -f "$VENV"/.adaptis-deps-* && touch "$stamp"
else
  # The checkout may have moved (CI clones elsewhere): repoint the editable install, fast.
  "$VENV/bin/pip" install -q --no-deps -e . >&2
fi

if [ "${1:-}" = "--test" ]; then
  # With the real node's kubelet, kube-proxy and CoreDNS (make test runs that tier): one
  # `go build` for every Kubernetes binary.
  bash hack/build-control-plane.sh --real-node >&2
fi
bash scripts/link-cli.sh "$VENV/bin" >&2
echo "$VENV/bin"
