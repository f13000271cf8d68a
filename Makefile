# The two README commands: `make demo` and `make test` (each sets up .venv first).
# `make test` = `make lint test-torch2.13 test-torch2.14`: ruff and mypy once, the whole suite on torch 2.13
# (.venv), then the core tests on torch 2.14 (.venv-torch2.14, built while lint runs).
PY := .venv/bin/python
PY214 := .venv-torch2.14/bin/python
# Two pytest-xdist workers for this 2-core machine (tests/conftest.py gives each worker cores/workers torch
# threads).  The whole suite: each file on one worker, the longest first (see tests/conftest.py).  The core tests
# have no shared port or module fixture: test by test.
PYTEST := -m pytest -q -n 2
# The core tests, also run on torch 2.14 (the one list of them): capture, planning, the runtime, the training loop
# (gpt2-tiny, llama-tiny), the Lightning, Accelerate and DDP integrations end to end.  The slower
# files (model families, plan quality, launches, CLI, benchmarks, examples) run on torch 2.13 only.
CORE_TESTS := tests/test_torch_versions.py tests/test_api.py tests/test_programs_table.py tests/test_session.py \
	tests/test_memory.py tests/test_layers.py tests/test_training_loop.py tests/test_lightning.py \
	tests/test_accelerate_hook.py tests/test_ddp.py tests/test_rank_agreement.py tests/test_mixed_precision.py \
	tests/test_compile.py tests/test_segmented_backward.py tests/test_output_usage.py tests/test_dropout_masks.py \
	tests/test_repeated_layers.py tests/test_planning_runs.py tests/test_hf_cache.py tests/test_user_checkpointing.py \
	tests/test_module_hooks.py tests/test_replayed_shapes.py tests/test_hf_trainer.py \
	tests/test_autograd_functions.py tests/test_host_random.py tests/test_module_attributes.py tests/test_hf_masks.py \
	tests/test_interpolations.py tests/test_mixture_of_experts.py tests/test_profiled_inputs.py tests/test_tensor_checks.py \
	tests/test_recurrent_layers.py tests/test_draw_order.py tests/test_stride_fallbacks.py tests/test_cast_cache.py \
	tests/test_graded_constants.py tests/test_assigned_tensors.py tests/test_tensor_hooks.py
# On torch 2.14 the budget sweeps (test_api's and the mixed-precision ones, ~200 s), the second compiled model, the
# two-process launches (DDP, Lightning DDP and its auto batch size, HF Trainer), the extra model families (MobileViT,
# LLaVA, MoE, BEiT, T5's decoder, RNN dropout) and autograd.grad interleaving (~660 s together) are left out: the
# other tests of those files reach the same torch APIs (export, the partitioner, traced_like_eager, inductor, the
# process group) in far less time.  The whole suite passed on torch 2.14 by hand (README).  CI aims at 30 minutes
# for both runs and the set-up; it took 65 on this machine's slow state (2026-11-30).
CORE_DESELECT := -k "not every_budget and not budget_sweep and not stays_under_budget[bert-tiny] \
	and not two_processes and not under_ddp and not ddp_below and not ddp_buckets and not mobilevit and not llava \
	and not routed_and_shared and not beit and not t5_decoder_without and not retain_graph_and_interleaved \
	and not multi_layer_dropout_is_bitwise_eager[RNN"

.venv/ready: pyproject.toml constraints-dev.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints-dev.txt -e ".[test]"
	touch $@

.venv-torch2.14/ready: pyproject.toml constraints-dev.txt
	python3 -m venv .venv-torch2.14
	$(PY214) -m pip install -q --upgrade pip
	$(PY214) -m pip install -q torch==2.14.1
	$(PY214) -m pip install -q -c constraints-dev.txt -e ".[test]"
	touch $@

demo: .venv/ready
	$(PY) examples/plain_pytorch.py

lint: .venv/ready
	$(PY) -m ruff check remat_plugin integrations
	$(PY) -m mypy remat_plugin integrations

test-torch2.13: .venv/ready
	$(PY) $(PYTEST) --dist loadfile --no-loadscope-reorder --durations=15

test-torch2.14: .venv-torch2.14/ready
	$(PY214) $(PYTEST) $(CORE_TESTS) $(CORE_DESELECT)

# ruff and mypy on one core while pip builds .venv-torch2.14 on the other; then the two test runs.
test: .venv/ready
	$(MAKE) -j2 lint .venv-torch2.14/ready
	$(MAKE) test-torch2.13 test-torch2.14

.PHONY: demo lint test test-torch2.13 test-torch2.14
