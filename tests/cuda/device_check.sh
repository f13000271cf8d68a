#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine whose image holds a CUDA torch but not our other needs.
# Its torch is whatever the image has (it may be outside TESTED_TORCH: REMAT_ALLOW_UNTESTED_TORCH=1, and the logs
# say which); PuLP, highspy and transformers travel as wheels in .whl/ (the versions .venv has here):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl pulp==3.3.2 highspy==1.15.1 \
#     transformers==5.24.0
# Then, from the repository root there:  OUT=<folder> bash tests/cuda/device_check.sh
# Writes: cuda_tests.log (tests/cuda, the float32 tests in a process of their own), bench_cuda.{json,log} (python -m remat_plugin.bench --device cuda),
# compare_cuda.{md,json} (bench compare --device cuda, inductor), bench_cuda_big.{json,log} (gpt2-small, when BIG_S > 0),
# per_layer_price.log (tests/cuda/diagnostics/per_layer_price.py, when PRICE_S > 0).  Each step has its own time limit, so a slow one
# leaves the others' results.
set -u
OUT=${OUT:?set OUT to a folder for the logs}
export PYTHONUNBUFFERED=1 REMAT_ALLOW_UNTESTED_TORCH=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
rm -rf /tmp/site/remat_plugin && cp -r remat_plugin /tmp/site/ && cp -r integrations /tmp/site/remat_plugin/ || exit 1
export PYTHONPATH=/tmp/site
cd /tmp || exit 1  # import remat_plugin from the installed copy, not the checkout's folder
REPO=$OLDPWD
{
  nvidia-smi -L
  python3 -c "import torch, transformers, pulp, highspy; print('torch', torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(), '| transformers', transformers.__version__, '| pulp', pulp.__version__)"
} 2>&1 | tee "$OUT/bench_cuda.log"

# Two pytest processes, so a crash in the float32 (fused-attention) tests leaves the others' report; a per-test
# limit (pytest-timeout, where installed) keeps one slow test from taking the whole report with it.
PER_TEST=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${PER_TEST_S:-100}")
: > "$OUT/cuda_tests.log"
for selection in "not float32" "float32"; do
  timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rA --durations=10 \
    $PER_TEST --rootdir "$REPO" -c "$REPO/pyproject.toml" -k "$selection${TESTS_K:+ and ($TESTS_K)}" \
    "$REPO/tests/cuda" 2>&1 | tee -a "$OUT/cuda_tests.log"
  echo "tests/cuda -k '$selection' exit: ${PIPESTATUS[0]}" | tee -a "$OUT/cuda_tests.log"
done

# A GPU-sized model (GPT-2 small's shape at 8 x 1024), where kernels rather than per-op dispatch make the step.
if [ "${BIG_S:-0}" -gt 0 ]; then
  timeout "$BIG_S" python3 -X faulthandler -m remat_plugin.bench --device cuda --model gpt2-small \
    --budgets "${BIG_BUDGETS:-1.0,0.5}" --pairs 5 --json "$OUT/bench_cuda_big.json" 2>&1 | tee "$OUT/bench_cuda_big.log"
  echo "big bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench_cuda_big.log"
fi

# Our plan against checkpointing priced by our own cost model, GPT-2 small on the GPU (Known limits, GPU).
if [ "${PRICE_S:-0}" -gt 0 ]; then
  timeout "$PRICE_S" python3 "$REPO/tests/cuda/diagnostics/per_layer_price.py" cuda gpt2-small 0.38 0.42 0.5 2>&1 \
    | tee "$OUT/per_layer_price.log"
fi

timeout "${BENCH_S:-130}" python3 -X faulthandler -m remat_plugin.bench --device cuda --model "${BENCH_MODELS:-gpt2-tiny,llama-tiny,resnet-tiny}" \
  --budgets "${BENCH_BUDGETS:-1.0,0.6,0.4,0.3}" --pairs 7 --json "$OUT/bench_cuda.json" 2>&1 | tee -a "$OUT/bench_cuda.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench_cuda.log"

[ "${COMPARE_S:-150}" -gt 0 ] && timeout "${COMPARE_S:-150}" python3 -X faulthandler -m remat_plugin.bench compare --device cuda --models gpt2-tiny \
  --amb-ratios 1.0,0.5 --budgets 1.0,0.5 --pairs 5 --out "$OUT/compare" 2>&1 | tee -a "$OUT/bench_cuda.log"
echo "compare exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench_cuda.log"
mv "$OUT"/compare/compare_cuda.md "$OUT"/compare/compare_cuda.json "$OUT"/ 2>/dev/null
rm -rf "$OUT/compare"
