# Two entry points on a fresh machine: `make demo` and `make test`.
# `make demo` installs what the demo runs (torch CPU + the [coordinator] extra: sklearn's digits, matplotlib,
# tqdm, the embedded broker); everything else (`make test`, `make install`) installs [dev]: the export toolchain
# (ONNX Runtime training, ExecuTorch) and the test tools too. Separate stamps: the full set satisfies the demo.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test install clean bench firmware native web-deps

$(BIN)/pip:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(BIN)/pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[coordinator]"
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml | $(BIN)/pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP) $(DEMO_STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/fedge simulate --devices 20 --clients-per-round 10 --rounds 30 --epochs 5 \
		--out runs/demo/report.json --plot runs/demo/report.png

# The browser device's npm packages (clients/web/package-lock.json); without npm its tests say why they skip.
web-deps:
	@if [ -d clients/web/node_modules ]; then :; elif command -v npm >/dev/null 2>&1; then \
		npm ci --prefix clients/web --no-audit --no-fund --silent; \
	else echo "npm not found: the browser device's tests will skip (apt-get install npm chromium)"; fi

test: $(STAMP) web-deps
	$(BIN)/python -m pytest -q

firmware: $(STAMP)
	$(BIN)/python -m firmware_tests --runtime all
	$(BIN)/python -m firmware_tests --protocol

native: $(STAMP)
	bash scripts/build_native.sh build/native

bench: $(STAMP)
	$(BIN)/python benchmarks/fedavg_mqtt.py

clean:
	rm -rf $(VENV) runs
