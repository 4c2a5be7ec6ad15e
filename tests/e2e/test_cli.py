"""The command-line client (``python -m ardit_cli``) as a user runs it, against the real three services."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


def ardit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARDIT_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "ardit_cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def served_knobs(stack) -> list[dict]:
    return httpx.get(f"{stack.gateway_url}/v1/models", timeout=30).json()["data"][0]["ardit"]["knobs"]


def option(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_generate_over_grpc_shows_progress_and_writes_the_images_the_api_makes(stack, tmp_path):
    done = ardit("generate", "a red fox", "-o", "fox.png", "--size", "128x64", "-n", "2", "--seed", "7",
                 "--num-inference-steps", "3", "--text-guidance-scale", "2.5", "--cfg-range", "0", "0.5",
                 "--top-k", "50", "--grpc", stack.ar_address, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # 64 pixels high = 4 grid rows per image; 3 steps per image (not the model's 50): the knob reached the DiT
    assert "AR rows: 8/8" in done.stderr.splitlines(), done.stderr
    assert "denoise steps: 6/6" in done.stderr.splitlines(), done.stderr
    assert f"wrote {Path('fox-0.png')} (128x64, seed 7)" in done.stdout and f"wrote {Path('fox-1.png')} (128x64, seed 8)" in done.stdout
    assert re.search(r"^request img-[0-9a-f]+ in \d+ ms \(8x4-token grid, AR decode", done.stdout, re.M), done.stdout
    written = [(tmp_path / f"fox-{i}.png").read_bytes() for i in range(2)]
    assert [Image.open(io.BytesIO(data)).size for data in written] == [(128, 64), (128, 64)]
    # the same request through the REST API: every knob went through, so the images are the same
    body = {"prompt": "a red fox", "size": "128x64", "n": 2, "seed": 7, "num_inference_steps": 3,
            "text_guidance_scale": 2.5, "cfg_range": [0, 0.5], "top_k": 50}
    answer = httpx.post(f"{stack.gateway_url}/v1/images/generations", json=body, timeout=120).json()
    for data, item in zip(written, answer["data"], strict=True):
        assert np.array_equal(pixels(data), pixels(base64.b64decode(item["b64_json"])))


def test_generate_over_rest_writes_the_image_of_the_requested_size(stack, tmp_path):
    done = ardit("generate", "a lighthouse", "-o", "out/light.jpg", "--size", "64x96", "--seed", "3",
                 "--num-inference-steps", "2", "--url", stack.gateway_url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    image = Image.open(tmp_path / "out" / "light.jpg")
    assert image.format == "JPEG" and image.size == (64, 96)  # the format follows the file's suffix
    # The gateway's stream feeds the progress lines.
    lines = done.stderr.splitlines()
    assert "denoise steps: 2/2" in lines, done.stderr


def test_an_unknown_knob_is_refused_naming_the_models_knobs(stack, tmp_path):
    done = ardit("generate", "a fox", "--no-such-knob", "3", "--url", stack.gateway_url, cwd=tmp_path)
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-knob 3" in done.stderr
    listed = done.stderr.split("the knobs of tiny are: ")[1].split()
    assert [name.rstrip(",") for name in listed] == [option(knob["name"]) for knob in served_knobs(stack)]
    assert not list(tmp_path.iterdir())  # nothing was generated


def test_a_value_the_server_refuses_is_an_error_naming_the_parameter(stack, tmp_path):
    for transport in (["--url", stack.gateway_url], ["--grpc", stack.ar_address]):
        done = ardit("generate", "a fox", "--size", "64x64", "--top-k", "0", *transport, cwd=tmp_path)
        assert done.returncode == 1, done.stderr
        assert "ardit: error: 'top_k' must be >= 1" in done.stderr and "(parameter: top_k)" in done.stderr


def test_help_lists_every_knob_of_the_servers_table(stack, tmp_path):
    knobs = served_knobs(stack)
    for transport in (["--url", stack.gateway_url], ["--grpc", stack.ar_address]):
        done = ardit("generate", "--help", *transport, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        text = " ".join(done.stdout.split())  # argparse wraps lines
        assert "knobs of tiny (mammothmoda2 preview), from the server's table" in text
        for knob in knobs:
            assert option(knob["name"]) in text and knob["description"].split(";")[0] in text, knob
        assert "--num-inference-steps N Denoising steps (overrides the quality preset). [default 50; >= 1 and <= 200]" in text
        assert "--cfg-execution-mode {sequential,packed}" in text
    listing = ardit("models", "--grpc", stack.ar_address, cwd=tmp_path)
    assert listing.returncode == 0 and all(option(knob["name"]) in listing.stdout for knob in knobs)
    assert "  visual-token grid: one visual token per 16x16 pixels" in listing.stdout.splitlines()


def test_help_without_a_server_says_where_the_knobs_would_come_from(tmp_path):
    done = ardit("generate", "--help", "--url", "http://127.0.0.1:9", cwd=tmp_path)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "which could not be fetched: cannot reach the gateway at http://127.0.0.1:9" in text
    assert "--num-inference-steps N" not in text
    generate = ardit("generate", "a fox", "--grpc", "127.0.0.1:9", cwd=tmp_path)
    assert generate.returncode == 1
    assert generate.stderr.startswith("ardit: error: cannot reach ar_service at 127.0.0.1:9")


def test_the_console_script_is_the_cli(capsys):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"ardit": "ardit_cli.main:main"}
    from ardit_cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "generate" in out and "models" in out
