"""ardit's REST gateway: OpenAI's Images API in front of ar_service's gRPC ImageGenerator.

Thin by design: it validates the OpenAI request shape, translates it into one
``GenerateImageRequest`` (typed fields plus a ``knobs`` map the model service validates),
and translates the answer and gRPC errors back into OpenAI's JSON shapes. No model, no torch.
"""
