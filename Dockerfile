# Two stages: the build stage has the compiler, the runtime image does not (nothing in it can build
# code an intruder brings). torch==2.13.0 is pinned in pyproject.toml. PyPI's Linux wheel of it is
# the CUDA build (several GB, what an executor on a GPU host needs); a CPU-only image takes it from
# PyTorch's CPU index instead:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim AS build
ARG TORCH_INDEX=
# g++ builds the DeltaNet layers' C++ CPU kernels (kernels/cpu_ext.py) here, for the CPU family the
# image targets (-march of the build machine's: build on the kind of machine that will run it); the
# runtime image has no compiler, so a CPU the prebuilt kernels do not fit runs the torch kernels
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY . /app
RUN if [ -n "$TORCH_INDEX" ]; then pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX"; fi \
    && pip install --no-cache-dir .
# the build lands in the environment (/opt/venv/var/radixflow/cpu_kernels/<cpu signature>)
RUN python -m radixflow.kernels.cpu_ext || echo "CPU kernels not prebuilt: the torch kernels serve"

FROM python:3.11-slim
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH RADIXFLOW_LOG_JSON=1
# an unprivileged user; the model volume and the kernels' build folder (its lock files) are its own
RUN useradd --system --uid 10001 --home-dir /home/radixflow --create-home radixflow \
    && mkdir -p /models /opt/venv/var/radixflow && chown -R radixflow /models /opt/venv/var/radixflow
USER radixflow
WORKDIR /home/radixflow
ENTRYPOINT ["radixflow"]
