#!/bin/sh
# Re-pin deploy/constraints/{operator,worker}.txt: resolve each image's extra against PyPI (with
# the torch pin of constraints.txt) and write every package it would install as name==version.
# Run after changing pyproject.toml's extras or constraints.txt; needs only pip and python3.
set -eu
cd "$(dirname "$0")/.."
pip=${PIP:-pip}
for extra in operator worker; do
  report=$(mktemp)
  "$pip" install --dry-run --ignore-installed --quiet --report "$report" -c constraints.txt ".[$extra]"
  python3 - "$report" "$extra" > "deploy/constraints/$extra.txt" <<'PY'
import json, sys
report, extra = sys.argv[1], sys.argv[2]
pins = sorted(
    (item["metadata"]["name"].lower().replace("_", "-"), item["metadata"]["version"])
    for item in json.load(open(report))["install"]
    if item["metadata"]["name"].lower() != "adaptis"
)
print(f"# Every package of the `{extra}` image, pinned (the Dockerfile installs with this file).")
print(f"# Regenerate with deploy/pin-constraints.sh after changing the [{extra}] extra of")
print("# pyproject.toml or constraints.txt; tests/charts/test_charts_image_venv.py fails when")
print("# an installed package is missing here.")
for name, version in pins:
    print(f"{name}=={version}")
PY
  rm -f "$report"
done
