"""Model code for the DiT stage: transformer, sampler, pipeline (load/denoise/decode) and the tiny test stack."""
