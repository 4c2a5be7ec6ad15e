"""ar_service settings (env prefix ARDIT_AR_)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from ar_service.edit_image import DEFAULT_EDIT_IMAGE_POSITIONS
from servicekit.settings import GrpcTarget, ModelServiceSettings


class ARSettings(ModelServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ARDIT_AR_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = any free port)")
    model_dir: Path = Field(Path("models/tiny"), description="MammothModa2 checkpoint directory (config.json, safetensors, tokenizer)")
    random_weights: bool = Field(
        False, description="random AR weights built on the device (benchmarks): the directory needs no safetensors"
    )
    model_id: str | None = Field(None, description="served model name (default: the model directory's name)")
    dit_address: GrpcTarget = Field(
        "127.0.0.1:50052",
        description="dit_service's gRPC target: host:port, dns:///name:port or ipv4:host:port,host:port (replicas: "
        "each Render goes to the next one serving)",
    )
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto (CUDA when present)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="model dtype (auto: bfloat16 on CUDA, float32 on CPU)"
    )
    max_prompt_tokens: int = Field(1024, ge=1, description="longest prompt accepted, in tokens")
    max_workers: int = Field(32, ge=2, description="gRPC handler threads")
    # -- limits --
    max_pixels: int | None = Field(
        None, ge=256, description="largest width * height of one image (default: the model's largest side squared)"
    )
    max_concurrent_streams: int = Field(100, ge=1, description="most concurrent gRPC streams per client connection")
    edit_max_image_bytes: int = Field(
        33_554_432, ge=1, description="largest input image file of an edit, in bytes: dit_service's bound on one "
        "reference, 32 MiB (OpenAI takes files under 50 MB)"
    )
    edit_max_total_bytes: int = Field(67_108_864, ge=1, description="largest sum of an edit's input image files, in bytes")
    edit_max_image_pixels: int = Field(
        40_000_000, ge=1, description="largest width * height of an edit's input image (larger: refused, a decompression bomb)"
    )
    edit_image_positions: int = Field(
        DEFAULT_EDIT_IMAGE_POSITIONS, ge=16, description="prompt positions all input images of an edit may take as "
        "MammothTok tokens (each image gets an equal share and is scaled down to fit it; bounded by the model's "
        "positions); the default holds a 1024x1024 input at the released 73x73 codes",
    )
    # -- batching and admission --
    max_batch_size: int = Field(
        8, ge=1, le=256,
        description="most images decoded together; an image takes one decode row, two with AR guidance (ar_cfg_scale "
        "> 1), and the decoder holds two rows per image: every eager decode step runs padded to 2 * max_batch_size "
        "rows (batch invariance)",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1,
        description="the fraction of the GPU's total memory ar_service may hold (weights, the fast decoder's K/V "
        "slots and CUDA-graph workspace; on CUDA a hard limit once the fast decoder is sized). The fast decoder is "
        "sized to it: when max_batch_size images do not fit, fewer decode together (a warning gives the figures), "
        "and when not even one does, the start is refused. Where dit_service shares the GPU, give each service its "
        "share of the card (dit_service takes what this one leaves: 0.7 leaves ~24 GiB for the Preview DiT on an "
        "80 GB GPU, as compose.gpu.yaml and bench/saturation.py set)",
    )
    max_queued_requests: int = Field(
        16, ge=0, description="requests that may wait for a slot; beyond this, RESOURCE_EXHAUSTED (HTTP 429) at once"
    )
    deterministic: bool = Field(
        False,
        description="torch deterministic algorithms (and CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set): for CUDA; "
        "the CPU is batch-invariant without it",
    )
    fast_decode: Literal["auto", "on", "off"] = Field(
        "auto",
        description="decode in fixed slots with an in-place K/V cache sized for the longest accepted request, captured "
        "in CUDA graphs on CUDA (auto: on for CUDA, off on CPU); with deterministic, every step attends over the "
        "whole cache (batch-invariant to the bit, slower)",
    )
    decode_kernels: Literal["auto", "triton", "torch"] = Field(
        "auto",
        description="with fast_decode: the decode step's kernels. triton: ardit's own (RMSNorm, bias, SwiGLU and "
        "residuals folded into the weight reads; attention over each row's own length, so one CUDA graph per row "
        "count); torch: cuBLAS and torch's kernels, one CUDA graph per row count and length bucket (auto: triton on "
        "CUDA when the triton package imports, 2 * max_batch_size <= 16 (64 with quantization fp8) and a start-up "
        "probe of the kernels passes, "
        "else torch)",
    )
    compile_decode: bool = Field(
        True,
        description="with fast_decode on CUDA: fuse the sampler's noise and, with decode_kernels torch, each layer's "
        "elementwise work with torch.compile (slower start)",
    )
    compile_decode_mode: Literal["default", "max-autotune-no-cudagraphs"] = Field(
        "default",
        description="torch.compile mode of compile_decode; max-autotune-no-cudagraphs also times Inductor's own "
        "matmul kernels against cuBLAS per shape (minutes more at start)",
    )
    decode_lookahead: bool = Field(
        False,
        description="with fast_decode: launch each stream's next token step before the host has handled the last "
        "one (same results; overlaps host and device work)",
    )
    capture_lane_graphs: bool = Field(
        False,
        description="with fast_decode, decode_kernels torch and CUDA graphs: capture the graphs of steps of lanes "
        "(speculative, row_parallel) at start too, so that no request waits for a capture under load (twice the "
        "graphs: a longer start and more memory, which may leave room for fewer images); otherwise each is captured "
        "the first time a step needs it",
    )
    decode_lane_rows: int = Field(
        0, ge=0, le=1024,
        description="with fast_decode: the rows one decode step of lanes (speculative, row_parallel) may run; a "
        "step's lanes beyond it go in further passes, each reading every weight again. 0 = auto: 64 with "
        "decode_kernels torch, the decode slots (2 * max_batch_size) with triton, whose row tile follows it (at most "
        "64); never fewer than the slots. With deterministic every step runs the slots' rows: leave it 0",
    )
    decode_lane_attention: Literal["auto", "gather", "triton", "triton-slots"] = Field(
        "auto",
        description="with fast_decode and decode_kernels torch: how a decode step of lanes (speculative, "
        "row_parallel) reads its rows' K/V slots. gather: copies each row's slot out of the cache at every layer; "
        "triton: reads each row's slot in place; triton-slots: reads each slot once for all of its rows in steps as "
        "wide as static_decode.GROUPED_LANE_ROWS or wider, once a row in narrower ones (auto: triton-slots on CUDA "
        "where the triton package imports and a start-up probe of its attention passes, else gather; gather with "
        "deterministic)",
    )
    prefix_cache: bool = Field(True, description="prefill the shared system-prompt prefix once and reuse its K/V")
    prefill_memo: int = Field(
        16, ge=0,  # generation.PREFILL_MEMO_ENTRIES (not imported: settings load without torch)
        description="keep this many repeated prefills by their token ids (negative prompts' conditions, AR-guided "
        "images' unconditional rows), so that a request using one already seen skips its forward (0 = off)",
    )
    metrics_port: int = Field(
        0, ge=0, le=65535,
        description="serve Prometheus metrics on this port (0 = off; e.g. 9451); a port in use refuses the start, like the gRPC port",
    )
    # -- shutdown --
    shutdown_drain_s: float = Field(0.0, ge=0, description="on SIGTERM, report NOT_SERVING this long before refusing calls")
    shutdown_grace_s: float = Field(10.0, ge=0, description="on SIGTERM, time in-flight requests get to finish before cancellation")
    # -- TLS (servicekit/tls.py): this server, and the channel to dit_service --
    tls_cert_file: Path | None = Field(None, description="PEM certificate chain: serve TLS (with tls_key_file)")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file")
    tls_client_ca_file: Path | None = Field(None, description="PEM CA: require client certificates it signed (mutual TLS)")
    dit_tls_ca_file: Path | None = Field(None, description="PEM CA that signed dit_service's certificate: talk TLS to it")
    dit_tls_cert_file: Path | None = Field(None, description="PEM client certificate presented to dit_service (mutual TLS)")
    dit_tls_key_file: Path | None = Field(None, description="PEM private key of dit_tls_cert_file")
    dit_tls_server_name: str | None = Field(None, description="name to verify dit_service's certificate against")
    log_prompts: bool = Field(False, description="log each request's prompt (off: logs carry lengths, never prompt text)")
    log_level: str = Field("info", description="debug, info, warning or error")

    @model_validator(mode="after")
    def _lane_rows_need_varying_steps(self) -> ARSettings:
        if self.deterministic and self.decode_lane_rows:
            raise ValueError("decode_lane_rows needs deterministic off: deterministic decoding runs every step, plain "
                             "or of lanes, at the decoder's slots (2 * max_batch_size rows)")
        if self.deterministic and self.decode_lane_attention not in ("auto", "gather"):
            raise ValueError("decode_lane_attention triton and triton-slots need deterministic off: deterministic steps "
                             "of lanes attend as the plain steps do (gather or auto)")
        return self
