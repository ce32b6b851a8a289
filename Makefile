# Two commands set everything up on a fresh machine:  make demo  and  make test.
# Both create .venv (if missing) and install requirements.txt + effdl (editable) into it.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PIP    := $(PY) -m pip --quiet --no-cache-dir
RUNS   := runs

.PHONY: demo test test-gpu gpu-check lint reports reports-commit clean \
        demo-task1 demo-task2 demo-task3 demo-gpt2 demo-swiglu demo-lm demo-parallel

# No pip cache: it would keep a second copy of every wheel (several GB with torch's CUDA packages).
$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	@touch $@

test: $(STAMP)
	$(PY) -m pytest -q --durations=10

# On a machine with a GPU and torch preinstalled: PYTHONPATH=. python3 -m pytest -m gpu
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

# Every README GPU command, briefly, on the GPUs this host has: the system Python, no venv.
gpu-check:
	$(PYTHON) tools/gpu_check.py --out $(RUNS)/acceptance $(GPU_CHECK_FLAGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Every task in quick mode on embedded data, then the reports against those fresh logs.
demo: $(STAMP)
	@rm -rf $(RUNS)/demo-failed
	@for t in demo-task1 demo-task2 demo-task3 demo-gpt2 demo-swiglu demo-lm demo-parallel; do \
	  $(MAKE) --no-print-directory $$t || { mkdir -p $(RUNS); touch $(RUNS)/demo-failed; echo "FAILED: $$t"; }; \
	done
	@$(MAKE) --no-print-directory reports
	@test ! -e $(RUNS)/demo-failed || { echo "FAILED: some demo tasks (see above)"; exit 1; }
	@echo
	@echo "demo done: run logs in $(RUNS)/<task>/, executed reports (ipynb + html) in $(RUNS)/reports/"

demo-task1: $(STAMP)
	@echo "== task1_loss_scaling: UNet segmentation under every precision/scaler mode (quick)"
	$(PY) task1_loss_scaling/train_unet.py --quick --device cpu --out $(RUNS)/task1
	$(PY) task1_loss_scaling/lm_precision.py --quick --device cpu --out $(RUNS)/task1
	$(PY) tools/stand_in_data.py --quick --tasks task1 --out $(RUNS)
demo-task2: $(STAMP)
	@echo "== task2_batching: padded, bucketed and packed pipelines (quick)"
	$(PY) task2_batching/mock_epoch.py --quick --device cpu --out $(RUNS)/task2
	$(PY) task2_batching/train_pipelines.py --quick --device cpu --out $(RUNS)/task2
	$(PY) task2_batching/sampler_costs.py --quick --out $(RUNS)/task2
	$(PY) task2_batching/packing_costs.py --quick --out $(RUNS)/task2
	$(PY) tools/stand_in_data.py --quick --tasks task2 --out $(RUNS)
demo-task3: $(STAMP)
	@echo "== task3_vit_profiling: one ViT epoch + validation and a profile, the pipeline as given and fixed (quick)"
	$(PY) task3_vit_profiling/train.py --quick --device cpu --pipeline as_given --data-cache $(RUNS)/cache/task3 --out $(RUNS)/vit
	$(PY) task3_vit_profiling/train.py --quick --device cpu --pipeline fixed --data-cache $(RUNS)/cache/task3 --out $(RUNS)/vit
	$(PY) task3_vit_profiling/profile_model.py --quick --device cpu --pipeline as_given --data-cache $(RUNS)/cache/task3 --out $(RUNS)/vit --wait 0 --warmup 1 --active 1 --overhead-rounds 1 --overhead-seconds 0 --overhead-steps 1 --sample-every 2 --compare-sample-every 2
	$(PY) task3_vit_profiling/profile_model.py --quick --device cpu --pipeline fixed --data-cache $(RUNS)/cache/task3 --out $(RUNS)/vit --wait 0 --warmup 1 --active 1 --overhead-rounds 1 --overhead-seconds 0 --overhead-steps 1 --sample-every 2 --compare-sample-every 2
	$(PY) tools/stand_in_data.py --quick --tasks vit --out $(RUNS)
demo-gpt2: $(STAMP)
	@echo "== memory_efficient_gpt2: offloaded Adam on a tiny GPT-2 (quick)"
	$(PY) memory_efficient_gpt2/train.py --quick --out $(RUNS)/gpt2
	$(PY) memory_efficient_gpt2/train.py --quick --fixed-batch --out $(RUNS)/gpt2
	$(PY) memory_efficient_gpt2/baseline.py --quick --out $(RUNS)/gpt2
demo-swiglu: $(STAMP)
	@echo "== swiglu_checkpoint: GPU ceilings (quick)"
	$(PY) swiglu_checkpoint/gpu_ceilings.py --quick --device cpu --out $(RUNS)/ceilings
	@echo "== swiglu_checkpoint: recomputation benchmark (quick)"
	$(PY) swiglu_checkpoint/benchmark.py --quick --device cpu --out $(RUNS)/swiglu
	$(PY) swiglu_checkpoint/probes/gemm_kernel_count.py --device cpu --out $(RUNS)/swiglu/probes
demo-lm: $(STAMP)
	@echo "== lm_training: tiny Llama on the stdlib corpus, seed-002 data answers (quick)"
	$(PY) lm_training/train.py --quick --cache $(RUNS)/cache/lm --out $(RUNS)/lm_training
	$(PY) lm_training/data_deliverables.py --quick --cache $(RUNS)/cache/lm --out $(RUNS)/lm_training
	$(PY) lm_training/speedup_stages.py --quick --cache $(RUNS)/cache/lm --out $(RUNS)/lm_training
	$(PY) lm_training/layer_norm_benchmark.py --quick --out $(RUNS)/lm_training
demo-parallel: $(STAMP)
	$(PY) memory_efficient_gpt2/tensor_parallel.py --quick --out $(RUNS)/parallelism
	$(PY) memory_efficient_gpt2/pipeline_parallel.py --quick --reference --device cpu --out $(RUNS)/parallelism
	$(PY) memory_efficient_gpt2/pipeline_parallel.py --quick --reference --accumulate --device cpu --out $(RUNS)/parallelism
	$(PY) memory_efficient_gpt2/pipeline_parallel.py --quick --out $(RUNS)/parallelism
	$(PY) memory_efficient_gpt2/pipeline_parallel.py --quick --long --out $(RUNS)/parallelism

# Executed copies + HTML of every reports/*.ipynb against the demo's fresh logs.
reports: $(STAMP)
	$(PY) -m effdl.notebooks --results $(RUNS) --out $(RUNS)/reports

# Re-execute the committed notebooks in place against the committed GPU logs.
reports-commit: $(STAMP)
	$(PY) -m effdl.notebooks --results reports/results --in-place

clean:
	rm -rf $(RUNS) .pytest_cache .ruff_cache
