# Two entry points for a fresh machine: `make train-mnist` and `make test`.
# Each builds .venv on first use. torch is pinned to the build PyPI's torchvision
# was compiled against: an unmatched torch (e.g. a local 2.13.0+cpu wheel) makes
# torchvision fail to import ("operator torchvision::nms does not exist").
PYTHON ?= python3
VENV   ?= .venv
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.2

.PHONY: venv train-mnist test test-fast clean
venv: $(VENV)/.installed

# pip install gets three tries: a download broken off mid-file (IncompleteRead) is not retried by pip itself.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	for try in 1 2 3; do $(VENV)/bin/python -m pip install -q $(TORCH_PINS) -e '.[test]' && exit 0; \
	  echo "pip install failed (try $$try of 3)" >&2; sleep 5; done; exit 1
	touch $@

train-mnist: venv
	$(VENV)/bin/ddpkit train --dataset mnist --model convnet --nproc 2 --epochs 2

# Three tests at a time on 2 cores: with two, the machine idled 13.5% of the run (tests waiting on a signal, a
# timeout, their workers' start); with three, 3% (BENCHMARKS.md, the test suite's wall time).
# worksteal, not loadscope: loadscope ran a module whole on one worker, so the run ended on one worker still in a
# module of slow tests while the other idled; reference runs that several tests share are made once per run
# whichever worker asks (tests/helpers/once.py).
# The 25 slowest tests are listed at the end: where the suite's time goes.
# The fast loop while editing: .venv/bin/python -m pytest -m "not multiprocess"
# compileall first: where PYTHONDONTWRITEBYTECODE is set (this CI's image) no process writes .pyc files, so each
# launcher, forkserver and worker compiled ddpkit's sources again (~0.2 s a process, hundreds of processes a run).
test: venv
	$(VENV)/bin/python -m compileall -q src tests
	$(VENV)/bin/python -m pytest -q -n 3 --dist worksteal --durations=25

# The edit loop with processes: every test but those marked slow (over ~10 s each: world-2 runs, kills and resumes);
# <= 4 min on 2 cores. make test runs them all.
test-fast: venv
	$(VENV)/bin/python -m compileall -q src tests
	$(VENV)/bin/python -m pytest -q -n 2 --dist worksteal -m "not slow" --durations=10

clean:
	rm -rf $(VENV)
