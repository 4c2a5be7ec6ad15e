"""dit_service: renders images from AR condition hidden states (denoise with a DiT, VAE decode, encode).

Kept free of heavy imports so the transport and settings modules load without torch.
"""
