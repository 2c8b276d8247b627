# One entry point. The README's two commands are `make demo` and `make test`;
# both install what a fresh Debian machine lacks, start the local stack and reuse caches.

SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PG_MAJORS_TEST := 13,18
PG_MAJORS_ALL := 13,14,15,16,17,18
NOTEBOOKS := $(wildcard notebooks/[0-9][0-9]_*.ipynb)

.PHONY: install system fetch up down status logs sample demo test test-cluster coverage check compat lint jupyter clean run stop teardown faults soak bench
.SILENT: system demo status

install: system $(STAMP) fetch  ## everything a fresh machine needs (system packages, .venv, jars)

system:  ## Debian packages: a PostgreSQL server (Debian's default major), Java 17, Maven (only those missing)
	missing=()
	command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
	command -v mvn >/dev/null || missing+=(maven)
	ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || missing+=(postgresql)
	[ $${#missing[@]} -eq 0 ] && exit 0
	if [ "$$(id -u)" -ne 0 ]; then
	  echo "error: missing system packages: $${missing[*]}; install them with sudo apt-get install -y $${missing[*]}" >&2
	  exit 1
	fi
	# the stack runs its own cluster: don't let the package create and start a default one
	mkdir -p /etc/postgresql-common
	grep -qs '^create_main_cluster' /etc/postgresql-common/createcluster.conf || \
	  echo 'create_main_cluster = false' >> /etc/postgresql-common/createcluster.conf
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$${missing[@]}"

$(STAMP): requirements.txt pyproject.toml setup.py lib/capture/_native.pyx
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# first what the stack's downloads import: they run (Maven, about 40 s) while pip installs the rest
	$(PY) -m pip install -q $$(grep -E '^(pyspark|PyYAML|cryptography|psycopg2-binary)==' requirements.txt)
	$(PY) -m lib.local.stack fetch --downloads > $(VENV)/downloads.log 2>&1 & downloads=$$!
	$(PY) -m pip install -q -r requirements.txt
	# builds the capture's compiled hot path (Cython, a C compiler); without them the install goes on without it
	rm -f lib/capture/_native*.so
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c 'from lib.capture import native; print("capture   " + native.REASON)'
	status=0; wait $$downloads || status=$$?
	cat $(VENV)/downloads.log
	if [ $$status -ne 0 ]; then echo "error: the stack's downloads failed (exit $$status; the lines above)" >&2; exit 1; fi
	touch $(STAMP)

fetch: $(STAMP)  ## Kafka, Apicurio Registry and Spark's Delta/Kafka/Avro jars into .stack/cache
	$(PY) -m lib.local.stack fetch

up: install  ## start PostgreSQL, Kafka and the registry (idempotent)
	$(PY) -m lib.local.stack up

down:  ## stop the stack (data and logs stay in .stack/)
	$(PY) -m lib.local.stack down

status:  ## the stack's services, then the pipeline: services, slot lag and WAL, events/s, merge lag, warnings
	$(PY) -m lib.local.stack status
	echo
	$(PY) -m lib.operate.monitor

run: up  ## continuous mode: capture and merge as background processes (after notebooks 01-02, e.g. make demo)
	$(PY) -m lib.operate.service start

stop:  ## stop the capture and merge processes (the stack keeps running)
	$(PY) -m lib.operate.service stop

teardown:  ## drop the slot and publication (TOPICS=1: also the topics); says what is lost, acts only with YES=1
	$(PY) -m lib.operate.teardown $(if $(YES),--yes) $(if $(TOPICS),--topics)

logs:
	$(PY) -m lib.local.stack logs

sample: up  ## load the sample bank database (once)
	$(PY) -m lib.local.stack sample

demo: sample  ## the main job on the local stack: notebooks in order, executed copies under runs/
	if [ -z "$(NOTEBOOKS)" ]; then
	  echo "demo      no notebooks yet in notebooks/: the stack runs and the sample database is loaded"
	else
	  $(PY) -m lib.operate.jobs --target local
	fi
	$(PY) -m lib.local.stack status
	echo
	echo "Where to look:"
	echo "  executed notebooks  runs/<timestamp>/ (newest: $$(ls -1d runs/*/ 2>/dev/null | tail -1))"
	echo "  Jupyter             make jupyter      stop the stack: make down"

lint: $(STAMP)
	$(PY) -m ruff check $(wildcard lib tests bench notebooks)

test: sample lint  ## the suite against the running stack (notebooks under nbval; PostgreSQL 13 and 18 beside it); the cluster: test-cluster
	$(PY) -m lib.local.stack versions up $(PG_MAJORS_TEST)
	export CDC_PG_MAJORS=$(PG_MAJORS_TEST)
	# three workers, a module (the notebooks: all five, in order) on one; then the tests that need the stack alone
	status=0
	$(PY) -m pytest -n 3 -m "not serial and not cluster" --durations=25 $(PYTEST_ARGS) tests $(if $(NOTEBOOKS),--nbval-lax --nbval-current-env --nbval-cell-timeout=900 $(NOTEBOOKS)) || status=$$?
	$(PY) -m pytest -m "serial and not cluster" --durations=10 $(PYTEST_ARGS) tests || status=$$?
	exit $$status

test-cluster: sample  ## the tests on the local Spark cluster and through Spark Connect (CI runs them after make test)
	$(PY) -m pytest -m cluster --durations=10 $(PYTEST_ARGS) tests

coverage: sample lint  ## line coverage of lib/ over make test's and make test-cluster's suites, child processes included (slower; not CI)
	$(PY) -m lib.local.stack versions up $(PG_MAJORS_TEST)
	export CDC_PG_MAJORS=$(PG_MAJORS_TEST)
	rm -rf .stack/coverage && mkdir -p .stack/coverage
	status=0
	$(PY) -m coverage run -m pytest -n 3 -m "not serial and not cluster" -q tests $(if $(NOTEBOOKS),--nbval-lax --nbval-current-env --nbval-cell-timeout=900 $(NOTEBOOKS)) || status=$$?
	$(PY) -m coverage run -m pytest -m "serial and not cluster" -q tests || status=$$?
	$(PY) -m coverage run -m pytest -m cluster -q tests || status=$$?
	$(PY) -m coverage combine -q
	$(PY) -m coverage report --format=total > .stack/coverage/total.txt
	$(PY) -m coverage report | tail -3
	echo "line coverage of lib/: $$(cat .stack/coverage/total.txt) %"
	exit $$status

check: $(STAMP) lint  ## the fast loop: ruff and every test that needs no running service (no stack, under 2 minutes)
	$(PY) -m pytest -n 2 -m "not stack" tests

compat: up  ## the pipeline on every PostgreSQL major from 13 to 18 (servers started beside the stack)
	$(PY) -m lib.local.stack versions up
	CDC_PG_MAJORS=$(PG_MAJORS_ALL) CDC_PG_COPY_MAJORS=$(PG_MAJORS_ALL) $(PY) -m pytest --durations=10 tests/test_pg_versions.py tests/test_pgoutput_versions.py

faults: up  ## failure matrix under load (Kafka/PostgreSQL/registry down, kill -9, disk full...); docs/reliability.md
	$(PY) bench/fault_matrix.py $(if $(CASES),--cases $(CASES)) $(if $(CYCLES),--cycles $(CYCLES))

soak: up  ## an hour of mixed writes, DDL and a 1M-row transaction with the services: memory, WAL, catch-up, exact
	$(PY) bench/soak_bench.py --mixed $(if $(MINUTES),--minutes $(MINUTES))

bench: up  ## the short benchmarks in one table, a few minutes: capture backlog (TLS and plain TCP), snapshot, merge catch-up
	$(PY) bench/short.py

jupyter: up  ## JupyterLab on the notebooks, with the stack running
	$(PY) -m jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --no-browser

clean: $(STAMP)  ## stop the stack and delete its data and logs (downloads in .stack/cache stay)
	$(PY) -m lib.local.stack clean
