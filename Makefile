# The two commands README.md opens with. Each sets up .venv on first use (Python 3.11,
# the pinned CPU torch the machine's pip finds) and reuses it after.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

# Every file the installed package is made of. A strict editable install (below) links each
# file it finds at install time, so a new module or YAML file needs a reinstall; any newer
# file re-runs it (cheap), and so does a change of the build files or of this Makefile.
PACKAGE_FILES := $(shell find metaseq_oneload hydra_plugins hydra_configs -type f \( -name '*.py' -o -name '*.yaml' \) -not -path '*/__pycache__/*' 2>/dev/null)

# editable_mode=strict: a real folder of links on sys.path, which Hydra <= 1.3 needs to find
# hydra_plugins/ from any working directory (the default editable finder hides namespace
# packages from its scan). Never editable_mode=compat: it puts the repository root on
# sys.path, where hydra_configs/ would shadow metaseq_oneload.hydra_configs.
$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

$(STAMP): $(VENV)/.deps setup.cfg setup.py MANIFEST.in metaseq_oneload.pth pyproject.toml Makefile $(PACKAGE_FILES)
	$(PY) -m pip install -q --no-deps -e . --config-settings editable_mode=strict
	touch $@

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
