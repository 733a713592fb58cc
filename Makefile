# Two entry points on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench firmware native

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/fedge simulate --devices 20 --clients-per-round 10 --rounds 30 --epochs 5 \
		--out runs/demo/report.json --plot runs/demo/report.png

test: $(STAMP)
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
