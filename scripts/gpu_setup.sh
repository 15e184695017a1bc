# Source this on a GPU machine without network access, from the repository root: installs the
# wheels carried in .whl/ (datasets and friends) into /tmp/site and lctrain itself (editable, no
# dependencies), keeps NVLink multicast off for NCCL, keeps the hub offline, and makes $OUT.
#   . scripts/gpu_setup.sh && pytest -q -m gpu && lctrain bench kernel
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=/tmp/hf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
mkdir -p "${OUT:-/tmp/out}"
