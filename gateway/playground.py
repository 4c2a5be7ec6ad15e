"""``GET /``: the playground, one static page that drives the public REST API from a browser.

The page (gateway/static/playground.html) needs no build step and loads nothing from elsewhere: the
machines that run ardit may have no internet. It holds no secret, so it is served without an API key;
it asks for one when the API wants it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = Path(__file__).parent / "static" / "playground.html"

router = APIRouter()


@cache
def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


@router.get("/", include_in_schema=False, response_class=HTMLResponse)
async def playground() -> HTMLResponse:
    # no-cache: a browser revalidates, so an upgraded gateway serves its own page at once
    return HTMLResponse(_page(), headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})
