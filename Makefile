# Two entry points for a fresh machine: `make train-mnist` and `make test`.
# Each builds .venv on first use. torch is pinned to the build PyPI's torchvision
# was compiled against: an unmatched torch (e.g. a local 2.13.0+cpu wheel) makes
# torchvision fail to import ("operator torchvision::nms does not exist").
PYTHON ?= python3
VENV   ?= .venv
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.2

.PHONY: venv train-mnist test clean
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

# Two tests at a time: the multi-process tests mostly wait on their workers (BENCHMARKS.md, the test suite's wall time).
# The 25 slowest tests are listed at the end: where the suite's time goes.
# The fast loop while editing: .venv/bin/python -m pytest -m "not multiprocess"
test: venv
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadscope --durations=25

clean:
	rm -rf $(VENV)
