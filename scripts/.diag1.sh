set -o pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install --no-build-isolation --no-deps -q -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; exit 1; }
nvidia-smi -L
export BRIDGE_GPU_TEST_SKIP_BUILD=1
mkdir -p $OUT/w
( export CUDA_VISIBLE_DEVICES=0
  BRIDGE_GPU_TEST_TIMEOUT=200 BRIDGE_GPU_TEST_FILES="tests/test_gpu_wait.py" scripts/gpu-test $OUT/w/wait > /dev/null 2>&1
  BRIDGE_GPU_TEST_TIMEOUT=120 BRIDGE_GPU_TEST_FILES="tests/test_gpu_share.py" scripts/gpu-test $OUT/w/share > /dev/null 2>&1
  BRIDGE_GPU_TEST_TIMEOUT=80 BRIDGE_GPU_TEST_FILES="tests/test_gpu_numba.py" scripts/gpu-test $OUT/w/numba > /dev/null 2>&1
  PYTHONPATH=/tmp/site BRIDGE_GPU_TEST_TIMEOUT=80 BRIDGE_GPU_TEST_FILES="tests/test_gpu_rmm.py" scripts/gpu-test $OUT/w/rmm > /dev/null 2>&1
) &
( export CUDA_VISIBLE_DEVICES=1
  for m in native native-inductor bridge bridge-nocache; do timeout 40 python3 scripts/torch_alloc_probe.py $m >> $OUT/w/probe.txt 2>&1; echo "$m rc=$?" >> $OUT/w/probe.txt; done
  timeout 100 python3 -m bridge demo --out $OUT/demo.png > $OUT/w/demo.txt 2>&1; echo "demo rc=$?" >> $OUT/w/demo.txt
  BRIDGE_GPU_TEST_TIMEOUT=230 BRIDGE_GPU_TEST_FILES="tests/test_gpu_lightning.py" scripts/gpu-test $OUT/w/lightning > /dev/null 2>&1
) &
wait
cd $OUT && tar czf w.tgz w && rm -rf w
