#!/bin/sh
# Make the virtual environment of an AdaPtis image, the one way both the Dockerfile and the
# tests (tests/charts/test_charts_image_venv.py, and the real-node tier's images built from the
# Dockerfile itself) make it.
#
#   deploy/install-venv.sh VENV EXTRA --deps-only   # the pinned dependencies alone
#   deploy/install-venv.sh VENV EXTRA [SOURCE]      # the package (and any dependency missing)
#
# EXTRA is `operator` (kopf and the Kubernetes client, no torch) or `worker` (torch); every
# package comes pinned from deploy/constraints/EXTRA.txt. SOURCE: the checkout (default `.`).
# The Dockerfile runs --deps-only first, from deploy/constraints/ alone, so that a change to the
# package's code re-runs only the second step; the second step removes pip.
set -eu
venv=$1
extra=$2
src=${3:-.}
case "$extra" in
  operator|worker) ;;
  *) echo "install-venv: EXTRA must be operator or worker, not '$extra'" >&2; exit 2 ;;
esac
[ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
if [ "$src" = "--deps-only" ]; then
  # The pins are the whole closure of `.[EXTRA]` (deploy/pin-constraints.sh writes them).
  "$venv/bin/pip" install --no-cache-dir --quiet --requirement "deploy/constraints/$extra.txt"
  exit 0
fi
# A non-editable install: the image holds a built copy of the package, not the source tree.
"$venv/bin/pip" install --no-cache-dir --quiet \
  --constraint "$src/deploy/constraints/$extra.txt" "$src[$extra]"
# Nothing in the image needs pip at run time; leaving it out makes the operator image smaller.
"$venv/bin/pip" uninstall --quiet --yes pip
