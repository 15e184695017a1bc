# Source this on the lent GPU machine (no network): installs lctrain (editable, no deps) and the
# wheels carried in .whl/ (datasets and friends, made by ../shared/device/wheels.sh).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=/tmp/hf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
mkdir -p "${OUT:-/tmp/out}"
