# TeraIO artifact image: CUDA 13.0, Python 3.12, torch 2.11.0 (the versions of the H200 run
# in benchmarks/results/h200x2_llama3_8b_70gib/teraio_mixed_result.json.gz), this project
# with pyproject.toml's pins, libaio, and DeepSpeed's async_io and cpu_adam ops prebuilt.
#
#   docker build -t teraio .
#   docker run --rm -v "$PWD/runs:/opt/teraio/runs" teraio                  # smoke, on the CPU
#   docker run --rm --gpus all --ipc=host -v "$PWD/runs:/opt/teraio/runs" -v /mnt/nvme0:/mnt/nvme0 \
#       teraio python -m teraio.sweep +experiment=fig7_h200 model=llama3_8b_4l fig7.point=bs_small,bs_mid
#
# Not built where it was written (no Docker engine there); tests/test_docs.py checks it
# against pyproject.toml. Build it on the machine that runs it, or one of the same CPU
# generation: DeepSpeed compiles cpu_adam with -march=native.
#
# Base image: nvidia/cuda *devel*, not the runtime flavour and not NGC's PyTorch image.
# DeepSpeed's ops are compiled here (nvcc and the CUDA headers; cpu_adam links curand), and
# NGC images ship their own pre-release torch builds (2.x.0a0+...), which pyproject.toml's
# torch>=2.11 does not admit and which would not be the torch the H200 numbers came from.
# Ubuntu 24.04's python3 is 3.12, the GPU machine's Python.
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# libaio-dev: DeepSpeed's async_io op (ZeRO-Infinity's NVMe swapping).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv build-essential libaio-dev \
    && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04 refuses pip installs into the system Python (PEP 668): one venv for all.
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir --upgrade pip setuptools wheel ninja

# torch first and explicitly, from PyTorch's CUDA 13.0 index (pip's default torch may be a
# build for another CUDA); 2.11.0 is within pyproject.toml's torch>=2.11. A CUDA build
# brings its own triton, so the project's "cpu" extra is not installed.
RUN pip install --no-cache-dir torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130

# DeepSpeed with its ops compiled now rather than JIT-built at the first ZeRO run.
# DS_ACCELERATOR=cuda: the build sees no GPU and would otherwise record the CPU accelerator,
# and DeepSpeed loads a prebuilt op only for the accelerator it was built for.
# TORCH_CUDA_ARCH_LIST: no GPU to probe; A100 (8.0) and H100/H200 (9.0, plus PTX for newer
# GPUs). Plain "9.0", not "9.0a": DeepSpeed's arch parser rejects the suffix.
# --no-build-isolation: DeepSpeed's setup.py imports the torch installed above.
ENV TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX"
RUN DS_ACCELERATOR=cuda DS_BUILD_OPS=0 DS_BUILD_AIO=1 DS_BUILD_CPU_ADAM=1 \
        pip install --no-cache-dir --no-build-isolation deepspeed==0.19.8 \
    && python -c "from deepspeed.git_version_info import installed_ops as ops, accelerator_name as acc; \
assert ops['async_io'] and ops['cpu_adam'] and acc == 'cuda', (ops, acc)"

WORKDIR /opt/teraio
# The project, editable: Hydra finds conf/ beside teraio/, and DeepSpeed's JIT builds go to
# .torch_extensions/ in this checkout (baselines.zero.use_extensions_dir). The rest of the
# dependencies (torchtitan, torchao, hydra-core, kvikio-cu13, ...) come from pyproject.toml itself.
COPY pyproject.toml README.md ./
COPY teraio teraio
COPY baselines baselines
COPY analysis analysis
RUN pip install --no-cache-dir -e ".[test]"

COPY conf conf
COPY scripts scripts
COPY benchmarks benchmarks
COPY tests tests
COPY ae_README.md ./

# The smoke experiment in a container without GPUs uses DeepSpeed's CPU accelerator, whose
# ops are JIT-built: build them once now (scripts/build_ds_ops.py), not at every first run.
RUN DS_ACCELERATOR=cpu python scripts/build_ds_ops.py

# Kick the tires (ae_README.md); on a GPU host give the experiment instead (see the top).
CMD ["python", "-m", "teraio.sweep", "+experiment=smoke"]
