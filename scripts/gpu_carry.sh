#!/usr/bin/env bash
# The packages the GPU machine lacks for a real SGLang server (docs/gpu-server.md), made here and carried there:
# .whl/site.tar.xz (stock sglang 0.5.23 slimmed, sgl-flash-mla 1.0.0, 32 small dependencies; Python 3.12,
# manylinux x86_64, unpacked by benchmark/gpu/server.sh) and .whl/kernels/ (the CUDA LRU step built for sm_90).
# .whl/ is git-ignored; name .whl/site.tar.xz and .whl/kernels in the device call's carry. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}  # the kernel build imports torch
mkdir -p .whl/raw
# What stock sglang imports on a DeepSeek-V3.2 server and the GPU image lacks (found by importing it on a copy of
# the image; the IPython family is replaced by benchmark/gpu/stubs/IPython)
WHEELS=(sglang==0.5.23 sgl-flash-mla==1.0.0 annotated_types==0.8.0 apache_tvm_ffi==0.1.11 cffi==2.1.1
  compressed_tensors==0.18.0 dill==0.4.1 distro==1.9.0 fastapi==0.165.0 gguf==0.19.0 jiter==0.19.0
  jsonschema==4.26.0 jsonschema_specifications==2025.9.1 loguru==0.7.3 msgspec==0.22.0 openai==2.8.0
  opentelemetry_api==1.45.2 orjson==3.13.0 partial_json_parser==0.2.1.1.post7 pybase64==1.5.1 pycparser==3.12
  pydantic==2.14.4 pydantic_core==2.50.5 python_multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0
  rpds_py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 soundfile==0.13.1 starlette==1.10.0
  typing_inspection==0.4.5 uvicorn==0.54.0 xgrammar==0.2.7)
PLATFORMS=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 \
         manylinux_2_5 manylinux1; do PLATFORMS+=(--platform "${p}_x86_64"); done
echo "gpu_carry: downloading ${#WHEELS[@]} wheels for CPython 3.12 into .whl/raw"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d .whl/raw "${WHEELS[@]}" 2>&1 | { grep -v "is ignored" || true; }
rm -rf .whl/site && mkdir -p .whl/site
for w in .whl/raw/*.whl; do "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" .whl/site; done
# Never loaded by a DeepSeek-V3.2 server: the diffusion package and the Rust extensions of the benchmark client,
# gRPC, multimodal processors and the Rust server (sglang/srt/rust_extensions; the radix tree's stays)
rm -rf .whl/site/sglang/multimodal_gen .whl/site/sglang/srt/rust_extensions/_{bench,grpc,multimodal,server}.*
find .whl/site -name __pycache__ -prune -exec rm -rf {} +
echo "gpu_carry: packing .whl/site ($(du -sh .whl/site | cut -f1)) into .whl/site.tar.xz"
XZ_OPT=-T0 tar -cJf .whl/site.tar.xz -C .whl/site .  # xz on every core
echo "gpu_carry: .whl/site.tar.xz $(du -h .whl/site.tar.xz | cut -f1)"
# The CUDA LRU step for the H100 / H200 (sm_90), built by ess.core.kernels.lru_step_cuda where nvcc is (ESS_KERNEL_CACHE there)
if command -v nvcc >/dev/null || [ -n "${ESS_NVCC:-}" ]; then
  ESS_KERNEL_CACHE=.whl/kernels "$PY" -c "import sys; sys.path.insert(0, '.'); from ess.core.kernels.lru_step_cuda import build; print('gpu_carry:', build('sm_90'))" \
    || echo "gpu_carry: warning: the CUDA LRU step did not build here: the GPU machine builds it at its first use"
else
  echo "gpu_carry: no nvcc here: the GPU machine builds the CUDA LRU step at its first use"
fi
