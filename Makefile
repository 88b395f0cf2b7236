# The two commands of the README. Both set up everything first (idempotent, fast when done).
VENV ?= $(or $(ADAPTIS_VENV),$(HOME)/.cache/adaptis/venv)
export ADAPTIS_VENV := $(VENV)

# Lint and type caches live outside the repository, like the venv.
LINT_CACHE ?= $(or $(ADAPTIS_LINT_CACHE),$(HOME)/.cache/adaptis/lint)
export ADAPTIS_LINT_CACHE := $(LINT_CACHE)

# Checked by mypy --strict, clean; a room whose baseline reaches zero joins them, none leaves.
MYPY_STRICT := adaptis/api adaptis/planner

.PHONY: run test lint lint-only bench mutation
run:  ## set up, then train the embedded default job locally, from scratch each time (--fresh)
	bash scripts/setup.sh
	$(VENV)/bin/adaptis run examples/tiny-heterogeneous.yaml --fresh

# The real-node tier (pods in real containers; needs root) runs here, as on CI; REALNODE= leaves
# it out (the run then ends with "REAL-NODE TIER NOT RUN"). Cold cost: hack/README.md.
REALNODE ?= --realnode
test:  ## set up (Python env, control-plane and node binaries, Prometheus), then run every test
	bash scripts/setup.sh --test
	$(VENV)/bin/python -m pytest $(REALNODE)

lint:  ## set up, then ruff, the import contracts, mypy --strict on api and planner, mypy on the rest against its baseline
	bash scripts/setup.sh >/dev/null
	$(MAKE) --no-print-directory lint-only

# The checks alone, on whatever the venv holds: safe from a git worktree, whose setup.sh run would
# re-point the shared venv's editable install at that worktree.
lint-only:  ## ruff, the import contracts and both mypy passes, without setting up
	RUFF_CACHE_DIR=$(LINT_CACHE)/ruff $(VENV)/bin/ruff check --no-fix .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy --strict --cache-dir $(LINT_CACHE)/mypy-strict $(MYPY_STRICT)
	$(VENV)/bin/python scripts/mypy_baseline.py --cache-dir $(LINT_CACHE)/mypy $(MYPY_STRICT:%=--strict-path %)

bench:  ## the planner benchmark on the paper's workloads (writes bench/RESULTS.md)
	bash scripts/setup.sh
	$(VENV)/bin/python bench/planner_bench.py

mutation:  ## mutation score of the core modules within the hour (a benchmark, not CI; FULL=1: every mutant, hours; MODULES="adaptis/..." for some)
	bash scripts/setup.sh
	$(VENV)/bin/pip install -q -c constraints.txt mutmut  # on demand: not in what `make test` installs
	nice -n 10 $(VENV)/bin/python bench/mutation.py --cross-rank $(if $(FULL),,--quick) $(MODULES)
