import hashlib

import torch


def _hashes(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def test_written_twice_is_byte_identical_and_small(tmp_path, tiny_dit_dir):
    from dit_service.model.tiny import write_tiny_dit_stack

    write_tiny_dit_stack(tmp_path, condition_dim=64)
    assert _hashes(tmp_path) == _hashes(tiny_dit_dir)
    assert set(_hashes(tmp_path)) == {
        "dit/config.json", "dit/diffusion_pytorch_model.safetensors",
        "vae/config.json", "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json",
    }
    assert sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()) < 4 * 2**20


def test_output_layer_is_not_zero(pipeline):
    assert torch.count_nonzero(pipeline.transformer.proj_out.weight) > 0
