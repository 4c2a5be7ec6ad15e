"""Partial images (previews): how many a request may ask for, and after which denoising steps they come.

Every side needs the same answer: the gateway and ar_service check the count, dit_service makes the previews, and
a client can tell how many it will get. OpenAI's Images API accepts ``partial_images`` 0-3.
"""

from __future__ import annotations

MAX_PARTIAL_IMAGES = 3


def preview_steps(steps: int, partial_images: int) -> list[int]:
    """The steps (counted as steps done, 1 .. steps - 1) after which an image's previews are made.

    Evenly spaced: preview k of P comes after step floor(k * N / (P + 1)), k = 1 .. P, so they split the denoise into
    P + 1 equal parts and the last part ends with the final image. A step is never previewed twice and the final step
    never is (the final image follows it), so an image gets ``min(P, N - 1)`` previews: P whenever N > P.
    """
    if partial_images <= 0 or steps <= 1:
        return []
    chosen = {k * steps // (partial_images + 1) for k in range(1, partial_images + 1)}
    return sorted(step for step in chosen if 1 <= step < steps)
