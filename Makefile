# The two commands of the README. Both set up everything first (idempotent, fast when done).
VENV ?= $(or $(ADAPTIS_VENV),$(HOME)/.cache/adaptis/venv)
export ADAPTIS_VENV := $(VENV)

.PHONY: run test bench mutation
run:  ## set up, then train the embedded default job locally, from scratch each time (--fresh)
	bash scripts/setup.sh
	$(VENV)/bin/adaptis run examples/tiny-heterogeneous.yaml --fresh

test:  ## set up (Python env, control-plane binaries, Prometheus), then run every test
	bash scripts/setup.sh --test
	$(VENV)/bin/python -m pytest

bench:  ## the planner benchmark on the paper's workloads (writes bench/RESULTS.md)
	bash scripts/setup.sh
	$(VENV)/bin/python bench/planner_bench.py

mutation:  ## mutation score of the core modules within the hour (a benchmark, not CI; FULL=1: every mutant, hours; MODULES="adaptis/..." for some)
	bash scripts/setup.sh
	$(VENV)/bin/pip install -q -c constraints.txt mutmut  # on demand: not in what `make test` installs
	nice -n 10 $(VENV)/bin/python bench/mutation.py --cross-rank $(if $(FULL),,--quick) $(MODULES)
