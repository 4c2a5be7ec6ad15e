# One image for all three ardit services; compose.yaml picks the command.
FROM python:3.11-slim

# The PyTorch requirement, installed first. Pin your CUDA build here for GPUs,
# e.g. --build-arg TORCH_SPEC="torch==2.13.0".
ARG TORCH_SPEC="torch>=2.4"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 ardit
WORKDIR /app

RUN pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY servicekit ./servicekit
COPY ar_service ./ar_service
COPY dit_service ./dit_service
COPY gateway ./gateway
COPY tools ./tools
COPY ardit_cli ./ardit_cli
# The shapes model (train/README.md): what compose serves unless ARDIT_MODEL names another directory.
COPY train/checkpoints/shapes ./models/shapes
RUN pip install .

# /images: the gateway's URL image store in compose.yaml (a named volume takes this ownership)
RUN mkdir -p /models /images && chown ardit:ardit /models /images
USER ardit
VOLUME ["/models"]
EXPOSE 8000 50051 50052
CMD ["python", "-m", "gateway", "--host", "0.0.0.0"]
