"""dit_service settings (env prefix ARDIT_DIT_)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from dit_service.imaging import PNG_COMPRESS_LEVEL
from servicekit.settings import ModelServiceSettings


class DiTSettings(ModelServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ARDIT_DIT_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(50052, ge=0, le=65535, description="gRPC port (0 = any free port)")
    model_dir: Path = Field(Path("models/tiny"), description="MammothModa2 checkpoint directory (config.json + safetensors)")
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto (CUDA when present)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="model dtype (auto: bfloat16 on CUDA, float32 on CPU)"
    )
    max_condition_positions: int = Field(
        65_536, ge=1, description="most condition positions one Render may declare (bounds its memory)"
    )
    max_workers: int = Field(32, ge=2, description="gRPC handler threads")
    png_compress_level: int = Field(
        PNG_COMPRESS_LEVEL, ge=0, le=9,
        description="zlib level of answered PNGs: 1 is the fastest encode, 9 the smallest file (the pixels are the same)",
    )
    random_weights: bool = Field(
        False,
        description="build the checkpoint's DiT/VAE/refiner from config.json with random weights straight on the "
        "device, reading no tensors (benchmarks of a Preview-shaped model)",
    )
    # -- limits --
    max_side: int = Field(4096, ge=16, description="largest width or height one Render may ask for, in pixels")
    max_pixels: int = Field(4096 * 4096, ge=256, description="largest width * height one Render may ask for")
    max_chunk_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="largest condition chunk (tensor bytes) a Render stream may send"
    )
    max_condition_chunks: int = Field(16_384, ge=1, description="most condition chunks one Render stream may send")
    max_reference_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="largest reference image file (an edit's input image, the sum of its "
        "pieces) a Render stream may send; each piece is also bounded by max_chunk_bytes"
    )
    max_concurrent_streams: int = Field(256, ge=1, description="most concurrent gRPC streams per client connection")
    # -- batching and admission --
    max_batch_size: int = Field(
        4, ge=1, description="most images denoised together in one step-level batch (images of one size join and "
        "leave between steps)"
    )
    max_queued_renders: int = Field(
        16, ge=1, description="most renders admitted and waiting; beyond it Render is refused at once with "
        "RESOURCE_EXHAUSTED and a retry-after trailer"
    )
    batch_window_s: float = Field(
        0.02, ge=0, le=60.0,
        description="a render about to start a new batch while other renders are admitted (their conditions still "
        "arriving) waits up to this long for more of its size, so that they denoise and finish together; a render "
        "with nothing else admitted starts at once; 0 = off",
    )
    deterministic: bool = Field(
        False,
        description="batch-invariant on any device: each image in a transformer call of its own (no cross-request "
        "batching), torch.use_deterministic_algorithms and a fixed cuBLAS workspace; on CPU images are batch-invariant "
        "bit for bit without it",
    )
    cuda_graphs: int = Field(
        8, ge=0, description="CUDA graphs of the denoise step kept, one per call shape (the batch's latent size, rows "
        "and condition lengths): a shape seen twice is captured, then replayed; 0 = off; CUDA only",
    )
    warm_up: bool = Field(
        True, description="before reporting SERVING, run one made-up guided and unguided step and a VAE decode, so "
        "that kernel compilation and first-use setup (seconds on CUDA) do not land on the first request",
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="serve Prometheus metrics on this port (0 = off)")
    # -- shutdown --
    shutdown_drain_s: float = Field(0.0, ge=0, description="on SIGTERM, report NOT_SERVING this long before refusing calls")
    shutdown_grace_s: float = Field(10.0, ge=0, description="on SIGTERM, time in-flight renders get to finish before cancellation")
    # -- TLS (servicekit/tls.py) --
    tls_cert_file: Path | None = Field(None, description="PEM certificate chain: serve TLS (with tls_key_file)")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file")
    tls_client_ca_file: Path | None = Field(None, description="PEM CA: require client certificates it signed (mutual TLS)")
    log_level: str = Field("info", description="debug, info, warning or error")
