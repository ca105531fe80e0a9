# sglang-oea: `make test` runs the CPU test suite, `make demo` the CPU A/B demo.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.sglang-oea-installed
DEMO_OUT ?= out/demo

.PHONY: install test test-fast demo simulate wheel clean

install: $(STAMP)

$(STAMP): python/pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet "sglang==0.5.23"
	$(VPY) -m pip install --quiet -e "python[test]"
	touch $(STAMP)

# Everything, the real-server end-to-end tests included (40-45 minutes on 2 cores after setup). The tests
# without a server run in two workers, a file per worker (most of their time is Triton's
# interpreter and SGLang imports in child processes); then the server tests, one server at a time.
# Each phase ends with its 25 slowest test phases (--durations), to show where the time goes.
test: install
	$(VPY) -m pytest test/srt -q -p no:cacheprovider -m "not server" -n 2 --dist loadfile --durations=25
	$(VPY) -m pytest test/srt -q -p no:cacheprovider -m server --durations=25

# Without starting servers (a few minutes).
test-fast: install
	$(VPY) -m pytest test/srt -q -p no:cacheprovider -m "not server"

demo: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VPY) benchmark/oea/serving/demo.py --out-dir $(DEMO_OUT)

# The plugin's wheel in dist/, built offline with the venv's setuptools (README, "Install").
wheel: install
	$(VPY) -m pip wheel --no-deps --no-build-isolation -w dist ./python
	rm -rf python/build

simulate: install
	$(VPY) benchmark/oea/studies/simulate.py --out-dir out/simulate

clean:
	rm -rf out .pytest_cache
