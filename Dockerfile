# One image for all three ardit services; compose.yaml picks the command. Built with BuildKit (Docker's builder
# since Engine 23, and compose's): the wheelhouse is bind-mounted into the install steps, never copied into the image.
#
# Build arguments:
#   BASE_IMAGE       any Debian-like image with python3 (3.11 or newer) and its venv module; default python:3.11-slim.
#                    `make compose-test` builds one with debootstrap and `docker import`, where no registry is reached.
#   TORCH_SPEC       the PyTorch requirement, installed first. The default is the CPU build of the release CI tests
#                    (a few hundred MB instead of GBs of CUDA libraries); compose.gpu.yaml passes PyPI's CUDA build.
#   TORCH_INDEX_URL  where pip looks for TORCH_SPEC besides PyPI: PyTorch's CPU index by default, "" for PyPI alone.
#   WHEELHOUSE       "1": install every Python package from ./wheelhouse (filled on the host by `make wheelhouse`)
#                    with `pip install --no-index`, so that the build reaches no package index at all (README,
#                    "Air-gapped build"). Empty (the default): from the indexes, and wheelhouse/ is not read.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="ardit"

ARG TORCH_SPEC="torch==2.13.0+cpu"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
ARG WHEELHOUSE=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

RUN useradd --create-home --uid 10001 ardit
# A virtual environment: the same `python` on every base image, and no clash with a distribution's own packages.
RUN python3 -m venv /opt/venv
WORKDIR /app

# wheelhouse/ always exists (its README is committed); it holds wheels only where `make wheelhouse` put them.
RUN --mount=type=bind,source=wheelhouse,target=/tmp/wheelhouse \
    if [ -n "$WHEELHOUSE" ]; then set -- --no-index --find-links /tmp/wheelhouse; \
    elif [ -n "$TORCH_INDEX_URL" ]; then set -- --extra-index-url "$TORCH_INDEX_URL"; fi; \
    pip install "$@" "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY servicekit ./servicekit
COPY ar_service ./ar_service
COPY dit_service ./dit_service
COPY gateway ./gateway
COPY tools ./tools
COPY ardit_cli ./ardit_cli
RUN --mount=type=bind,source=wheelhouse,target=/tmp/wheelhouse \
    if [ -n "$WHEELHOUSE" ]; then set -- --no-index --find-links /tmp/wheelhouse; fi; \
    pip install "$@" . && rm -rf build ardit.egg-info
# The shapes models (train/README.md): the Dev one, which draws and edits, is what compose serves unless ARDIT_MODEL
# names another directory (/app/models/shapes: the Preview-layout one).
COPY train/checkpoints/shapes-dev ./models/shapes-dev
COPY train/checkpoints/shapes ./models/shapes

# /images: the gateway's URL image store in compose.yaml (a named volume takes this ownership)
RUN mkdir -p /models /images && chown ardit:ardit /models /images && rm -rf /tmp/wheelhouse
USER ardit
VOLUME ["/models"]
# 9451, 9452: ar_service's and dit_service's Prometheus metrics (compose.yaml turns them on)
EXPOSE 8000 50051 50052 9451 9452
CMD ["python", "-m", "gateway", "--host", "0.0.0.0"]
