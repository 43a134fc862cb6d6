# `make train` and `make test` each set up .venv first when it is missing or stale.
# jax >= 0.11 needs Python >= 3.12: tools/find_python.sh finds one (PYTHON=... picks it), and a
# .venv built on an older Python is rebuilt.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/gpt_tiny.yaml
OUTPUT ?= runs/gpt_tiny
TRAIN_ARGS ?=

.PHONY: install train test test-fast test-jax-min test-gpu-compile test-wheel test-slurm bench-slow-network-quick plan maxtext bench-maxtext clean

install: $(STAMP)

# Expanded only when the stamp is rebuilt; with no Python new enough, make stops with one line.
VENV_OK = $(shell $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && echo yes)
BASE_PY = $(shell PYTHON='$(PYTHON)' tools/find_python.sh 2>&1)

$(STAMP): pyproject.toml
	$(if $(VENV_OK),,$(eval BASE := $(BASE_PY))$(if $(filter /%,$(BASE)),rm -rf $(VENV) && $(BASE) -m venv $(VENV),$(error $(BASE))))
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/jaxspeed train $(CONFIG) --output $(OUTPUT) $(TRAIN_ARGS)

# The GPU suite's dry run (tests/test_gpu_suite.py, 2-3 minutes) runs in test-jax-min, on the JAX
# the GPU machine has, and not here.
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --durations=15 -m "not gpu_dry_run"

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow"

# The oldest supported JAX (the lent GPU machine's 0.11.2), in a venv of its own: a smoke subset
# of the tests and the GPU dry run (every kernel lowered for cuda, the GPU scripts' CPU checks;
# tests/test_gpu_suite.py runs it and checks what it printed).
JAX_MIN    := 0.11.2
VENV_MIN   ?= .venv-jax$(JAX_MIN)
SMOKE      ?= tests/test_mesh.py tests/test_onebit.py tests/test_moe_parallel.py tests/test_pipeline.py \
              tests/test_blocked_attention.py \
              tests/test_sequence_parallel.py::test_attention_equals_one_device \
              tests/test_sequence_parallel.py::test_layout_moves_chunk_pairs_and_back \
              tests/test_sampling.py::test_greedy_with_cache_equals_argmax_without \
              tests/test_packing.py::test_packed_row_equals_each_document_alone \
              tests/test_offload.py::test_host_update_matches_device_update \
              tests/test_autoplan_comm.py tests/test_params_checkpoint.py tests/test_profiler.py \
              tests/test_matmul.py tests/test_moe_routing_balance.py tests/test_step_probe.py \
              tests/test_moe_strategies.py tests/test_moe_host_tokens.py tests/test_update_cost.py \
              tests/test_moe_expert_tensor.py \
              tests/test_plan_processes.py \
              "tests/test_zero_step.py::test_explicit_zero3_equals_sharding_path_and_single_device[hosts2/tensor2/layer]" \
              tests/test_zero_step.py::test_zeropp_beside_tensor_parallelism_trains_like_zero3_and_moves_over_zero_axes_only \
              tests/test_muon.py::test_update_matches_a_float64_reference \
              "tests/test_muon.py::test_engine_matches_single_device[zero3_owner]" \
              "tests/test_muon.py::test_engine_matches_single_device[moe_expert2_zero3_owner]" \
              tests/test_qk_clip.py \
              tests/test_gpu_suite.py
# The smoke files' slow tests that repeat on more sizes, layouts or policies what the file's
# others check on this JAX, or that add only jaxspeed logic (auto's pricing, calibration) to
# paths the others run (the full suite runs them on the newest).
SMOKE_SKIP ?= tests/test_pipeline.py::test_pipeline_loss_sweep_matches_sequential \
              tests/test_pipeline.py::test_pipeline_outputs_sweep_matches_sequential \
              tests/test_mesh.py::test_two_emulated_hosts_train_as_one \
              tests/test_moe_routing_balance.py::test_chunked_and_hierarchical_exchanges_equal_one_device \
              tests/test_blocked_attention.py::test_benchmark_quick_run_prints_a_result_line \
              tests/test_moe_host_tokens.py::test_the_token_exchange_equals_the_slot_exchange \
              tests/test_moe_expert_tensor.py::test_biased_swiglu_experts_equal_one_device \
              "tests/test_matmul.py::test_gpt_bf16_step_is_the_same_widened_and_no_larger[none]" \
              "tests/test_matmul.py::test_gpt_bf16_step_is_the_same_widened_and_no_larger[dots_saveable]" \
              tests/test_step_probe.py::test_calibrate_with_a_model_takes_efficiency_from_its_timed_step \
              tests/test_moe_strategies.py::test_auto_picks_per_capacity_and_logs_the_choice \
              tests/test_moe_expert_tensor.py::test_auto_per_capacity_bucket_on_a_tensor_axis_equals_one_device \
              "tests/test_qk_clip.py::test_engine_clips_the_heads_past_the_threshold[zero3_explicit]" \
              tests/test_moe_routing_balance.py::test_a_bf16_layer_on_the_mesh_equals_one_device
test-jax-min: $(STAMP)
	test -x $(VENV_MIN)/bin/python || $(PY) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_MIN)/bin/python -m pip install --quiet -e '.[test]' jax==$(JAX_MIN) jaxlib==$(JAX_MIN)
	$(VENV_MIN)/bin/python -m pytest -n 2 --dist loadfile --durations=10 $(SMOKE) $(addprefix --deselect ,$(SMOKE_SKIP))

# The GPU half without a GPU, in a venv of its own with the gpu-compile extra (the CUDA plugin
# at jaxlib's version, ptxas, libdevice; ~410 MB): .venv stays without the plugin, which
# otherwise looks for CUDA at every start of a CPU-only JAX. Runs what the GPU dry run compiles
# (`gpu_suite.sh --dry-run` in this venv runs the same tests, plus the parts test-jax-min runs):
# every Mosaic GPU kernel configuration and the configs' train steps, compiled by XLA:GPU for
# H100/H200/A100 without a GPU. The kernels' GPU interpret-mode tests run in `make test`.
VENV_GPU ?= .venv-gpu
GPU_COMPILE_TESTS := tests/test_gpu_compile.py tests/test_block_sparse_attention_mgpu.py \
                     tests/test_moe_kernels_mgpu.py tests/test_moe_a2a_gpu.py tests/test_roofline_gpu.py
test-gpu-compile: $(STAMP)
	test -x $(VENV_GPU)/bin/python || $(PY) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_GPU)/bin/python -m pip install --quiet -e '.[test,gpu-compile]'
	$(VENV_GPU)/bin/python -m pytest -n 2 -m gpu_compile --durations=10 $(GPU_COMPILE_TESTS)

# jaxspeed as a user installs it (tools/test_wheel.sh): the wheel, built from a copy of the
# sources, installed into a clean venv outside the checkout (pip's cache serves jax & co.), and
# run from there: the shipped cluster presets, `plan --auto --cluster 8xh100-nvlink` and a
# 2-step `train` on a tiny config, `bench`'s one-line refusal. About 2-6 minutes.
WHEEL_WORK ?= $(or $(TMPDIR),/tmp)/jaxspeed-test-wheel
test-wheel: $(STAMP)
	tools/test_wheel.sh $(PY) $(WHEEL_WORK)

# A real SLURM cluster of two nodes on this machine (tools/local_slurm.sh: root, a network
# namespace per node, slurm-wlm installed with apt-get when missing), taken down afterwards
# whatever happens: examples/slurm/train.sbatch (the README's script) trained on it against one
# process; ranks that never come, a killed and a hung rank named; one elastic job through a lost
# node, a preemption and the time limit, against an uninterrupted run. About 6-7 minutes.
test-slurm: $(STAMP)
	tools/local_slurm.sh up 2
	$(PY) -m pytest -p no:cacheprovider -m slurm tests/test_slurm.py; \
	  status=$$?; tools/local_slurm.sh down; exit $$status

# Training across a real 100 Mbit/s link between two network namespaces (root, ip, tc with tbf,
# taskset; otherwise one line and exit 0): the link measured (TCP, calibrate across it), AdamW and
# 1-bit Adam, 6 steps each, ~3 minutes on 2 cores. Fails only on a broken run, never on a ratio.
# The full comparison: `benchmarks/slow_network.py` (see benchmarks/README.md).
bench-slow-network-quick: $(STAMP)
	$(PY) benchmarks/slow_network.py --quick

# MaxText beside jaxspeed (benchmarks/maxtext_peer.py): its own venv outside the repository
# (~2.5 GB, once), then the throughput benchmark's three configurations, both measured.
MAXTEXT_VENV ?= $(HOME)/.cache/jaxspeed-peers/maxtext
maxtext: $(STAMP)
	test -x $(MAXTEXT_VENV)/bin/python && $(MAXTEXT_VENV)/bin/python -c 'import maxtext' 2>/dev/null \
	  || $(PY) benchmarks/maxtext_peer.py setup --venv $(MAXTEXT_VENV)

bench-maxtext: maxtext
	$(PY) benchmarks/throughput.py --maxtext $(MAXTEXT_VENV)/bin/python

plan: $(STAMP)
	$(VENV)/bin/jaxspeed plan configs/gpt_tp2_zero3.yaml --cpu-devices 8

clean:
	rm -rf $(VENV) $(VENV_MIN) $(VENV_GPU) runs .pytest_cache
