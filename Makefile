# optlab: `make book` builds the book, `make test` runs every test, `make check` the fast tier. All create .venv on first use.
PYTHON ?= python3
VENV := .venv
# Python keeps the bytecode of what it compiles, as it does by default, in every command below: where
# PYTHONDONTWRITEBYTECODE is set, as in many containers, each process would compile the checkout's own modules (optlab,
# the tests, the tools) from source again, and `make test` starts hundreds (a kernel for each chapter, each command a
# test runs): half a minute of its time on two cores.
unexport PYTHONDONTWRITEBYTECODE
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install notebook-filter test check repeat book serve bench lab ddp-check shard-check gpu-check gpu-rehearsal mutants clean

install: $(STAMP) notebook-filter

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile -r requirements.txt -e .
# Bytecode for every installed module, on all cores (pip compiles on one), made once here rather than by whichever
# process first imports it: where PYTHONDONTWRITEBYTECODE is set outside make (Lab or pytest started by hand), nothing
# else would ever write it, and each new process (a notebook kernel, a rank) would compile torch again: 15 s more per
# process on 2 cores. The packages' own test suites are never imported, so they are left out (a fifth of the files).
# A few files are written for newer Pythons and cannot compile here; pip skips those the same way.
	$(PY) -m compileall -q -j 0 -x "/tests/|/testing/_internal/" $(VENV)/lib >/dev/null || true
	$(MAKE) --no-print-directory notebook-filter
	touch $(STAMP)

# Outputs and run metadata never reach a commit, whatever was saved: git passes every notebook it stages through
# tools/notebook_strip.py (nbstripout; .gitattributes names the filter), in the checkout's top folder, where .venv is.
# Outside a git checkout (an unpacked archive) there is nothing to set.
notebook-filter:
	if git rev-parse --git-dir >/dev/null 2>&1; then \
	  git config filter.nbstripout.clean '$(PY) tools/notebook_strip.py' && \
	  git config filter.nbstripout.smudge cat && \
	  git config filter.nbstripout.required true; fi

test: $(STAMP)  # everything, on every core (pytest-xdist): each chapter's run on its own, each other test file whole
	$(PY) -m pytest -n auto --dist loadfile

check: $(STAMP)  # the fast tier: every test but the chapters, the book, the browser and processes of their own; on
# every core (pytest-xdist), each test file in one worker so that its module fixtures are built once
	$(PY) -m pytest -m "not slow" -n auto --dist loadfile

repeat: $(STAMP)  # every test that starts processes, signals, forks or sleeps, 20 times in a row beside the chapters' runs
	$(PY) tools/repeat_tests.py $(TESTS)

book: $(STAMP)
	rm -rf _build/.doctrees _build/html _build/jupyter_execute results/live  # start clean: every page from this build
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

serve: $(STAMP)  # preview _build/html under the sub-path GitHub Pages serves it at (tools/site_server.py)
	$(PY) tools/site_server.py

bench: $(STAMP)
	$(PY) benchmarks/bench.py

ddp-check: $(STAMP)
	$(PY) -m optlab.studies.distributed parity

shard-check: $(STAMP)  # FSDP2 on two gloo processes against one process, and a checkpoint saved by 2 and loaded by 1
	$(PY) -m optlab.studies.distributed shard-check

mutants: $(STAMP)  # mutation run of the modules where a wrong number is silent (MODULE=timing: one); not in `make test`
	$(PY) -m pip install --quiet -r requirements-mutants.txt
	$(PY) tools/mutants.py $(if $(MODULE),--module $(MODULE))

gpu-check:  # the CUDA-only tests and the chapters' CUDA checks; the venv's Python if there is one, else $(PYTHON)
	PYTHONPATH=. $(if $(wildcard $(PY)),$(PY),$(PYTHON)) tools/gpu_check.py

gpu-rehearsal: $(STAMP)  # gpu-check on the CPU as a GPU machine runs it: its processes, order and folders, clean env
	$(PY) tools/gpu_check.py --rehearse

lab: $(STAMP) notebook-filter  # the chapters in JupyterLab (tools/lab_config.py); --allow-root: containers often run as root
	$(VENV)/bin/jupyter lab --allow-root --config tools/lab_config.py

clean:
	rm -rf _build results/runs
