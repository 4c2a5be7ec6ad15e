"""The REST transport: the gateway's OpenAI-compatible API (``GET /v1/models``, ``POST /v1/images/generations``,
``POST /v1/images/edits`` as multipart/form-data).

With ``stream: true`` the gateway answers server-sent events: OpenAI's ``image_generation.partial_image`` and
``image_generation.completed`` events (``image_edit.*`` for edits), and ardit's progress as SSE comments
(``: ardit.progress {json}``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx

from ardit_cli.models import ModelCard
from ardit_cli.request import CLIError, ImageRequest, Reporter


class RestClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))

    def close(self) -> None:
        self.http.close()

    # -- models -------------------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        response = self._send("GET", "/v1/models")
        return [ModelCard.from_json(model) for model in response.json().get("data", [])]

    # -- images -------------------------------------------------------------------------------

    def generate(self, request: ImageRequest, reporter: Reporter) -> None:
        body: dict[str, Any] = {
            "prompt": request.prompt, "n": request.n, "size": request.size, "quality": request.quality,
            "output_format": request.output_format, **request.knobs,
        }
        for name in ("seed", "negative_prompt", "model", "output_compression"):
            if getattr(request, name) is not None:
                body[name] = getattr(request, name)
        streamed = {**body, "stream": True, "partial_images": request.partial_images}
        if request.images:  # an edit: the same fields as form text (JSON for numbers and lists), the files beside
            form = {key: value if isinstance(value, str) else json.dumps(value) for key, value in streamed.items()}
            field = "image" if len(request.images) == 1 else "image[]"
            names = request.image_names or [f"image{i}.png" for i in range(len(request.images))]
            files = [(field, (name, data)) for name, data in zip(names, request.images, strict=True)]
            sent: dict[str, Any] = {"data": form, "files": files}
            path = "/v1/images/edits"
        else:
            sent, path = {"json": streamed}, "/v1/images/generations"
        try:
            with self.http.stream("POST", path, **sent) as response:
                if response.status_code == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
                    self._read_stream(response, request, reporter)
                    return
                response.read()
        except httpx.HTTPError as exc:
            raise CLIError(f"the request to the gateway at {self.url} failed: {exc}") from None
        raise CLIError(_error_text(response))

    def _read_stream(self, response: httpx.Response, request: ImageRequest, reporter: Reporter) -> None:
        completed = False
        for name, data in _sse(response.iter_lines()):
            if name == "ardit.progress":
                reporter.progress(data["image_index"], data["stage"], data["step"], data["total"])
            elif name == "ardit.completed":
                reporter.completed(data.get("request_id", ""), data.get("seed", 0), data.get("timings", {}))
                completed = True
            elif name in ("image_generation.partial_image", "image_edit.partial_image"):
                reporter.preview(data.get("image_index", 0), data["partial_image_index"], base64.b64decode(data["b64_json"]))
            elif name in ("image_generation.completed", "image_edit.completed"):
                width, height = (int(side) for side in data["size"].split("x"))
                seed = data.get("seed", (request.seed or 0) + data.get("image_index", 0))
                reporter.image(data.get("image_index", 0), seed, base64.b64decode(data["b64_json"]), width, height)
            elif name == "error":
                error = data.get("error", data)
                raise CLIError(f"{error.get('message', 'the stream failed')}" + _param_text(error))
            elif name == "[DONE]":
                if not completed:
                    reporter.completed("", 0, {})
                return
        raise CLIError("the gateway closed the stream before the last image")

    # -- plumbing -----------------------------------------------------------------------------

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CLIError(f"cannot reach the gateway at {self.url}: {exc}") from None
        if response.status_code != 200:
            raise CLIError(_error_text(response))
        return response


def _sse(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    """(name, parsed data) per server-sent event; ardit's comments ``: ardit.<name> {json}`` as events of that name;
    ``data: [DONE]`` as ("[DONE]", None)."""
    event, data = "message", list[str]()
    for line in lines:
        if line.startswith(":"):
            name, _, payload = line[1:].strip().partition(" ")
            if name.startswith("ardit.") and payload:
                yield name, json.loads(payload)
            continue
        if not line:
            if data:
                text = "\n".join(data)
                yield ("[DONE]", None) if text == "[DONE]" else (event, json.loads(text))
            event, data = "message", []
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            event = value
        elif field == "data":
            data.append(value)


def _param_text(error: dict[str, Any]) -> str:
    return f" (parameter: {error['param']})" if error.get("param") else ""


def _error_text(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return f"{error['message']}{_param_text(error)} [HTTP {response.status_code}]"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code} from the gateway: {response.text[:500]}"
