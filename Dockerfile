FROM python:3.11-slim
# torch==2.13.0 is pinned in pyproject.toml. PyPI's Linux wheel of it is the CUDA build (several GB,
# what an executor on a GPU host needs); a CPU-only image takes it from PyTorch's CPU index instead:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
ARG TORCH_INDEX=
# g++: the CPU kernels of the DeltaNet layers are compiled where they run (kernels/cpu_ext.py; built
# at run time, not here, since they are tuned to the CPU that runs them)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN if [ -n "$TORCH_INDEX" ]; then pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX"; fi \
    && pip install --no-cache-dir -e .
ENV RADIXFLOW_LOG_JSON=1
ENTRYPOINT ["radixflow"]
