"""The web chat page: `GET /` and its static files under `/webui/`.

The page (server/static/index.html, webui.js, webui.css; package data, so an installed wheel has them) is
plain HTML, CSS and JavaScript: no build step, nothing fetched from elsewhere. It talks to this server's own
`/v1/models` and `/v1/chat/completions` (streamed), sending the API key the user types as a Bearer header.

The page and its files are public (`public = True`, see server/guard.py): they hold no data, and a browser
cannot attach an Authorization header to a page load. Every /v1 route stays behind the key. Only the
files named in STATIC_FILES are served (a fixed table, so no path can reach anything else), each with a
Content-Security-Policy that allows scripts and styles from this origin only (no inline script: the HTML
has none) and `X-Content-Type-Options: nosniff`.
"""
from __future__ import annotations

from importlib import resources

import falcon

STATIC_PACKAGE_DIR = "static"          # server/static/
PAGE_FILE = "index.html"
STATIC_PREFIX = "/webui"

# name under /webui/ -> content type
STATIC_FILES = {
    "webui.js": "text/javascript; charset=utf-8",
    "webui.css": "text/css; charset=utf-8",
}

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",          # webui.js only: no inline script, no eval
    "style-src 'self'",
    "connect-src 'self'",         # fetch() to this server's /v1 routes
    "img-src 'self' data:",       # the page's empty data: favicon
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    # The files are small and change with the package: revalidate rather than serve a stale script.
    "Cache-Control": "no-cache",
}


class StaticFileMissing(RuntimeError):
    pass


def read_static(name: str) -> bytes:
    """A file of server/static/ (from the source tree or the installed package)."""
    try:
        return resources.files("server").joinpath(STATIC_PACKAGE_DIR, name).read_bytes()
    except (FileNotFoundError, OSError) as e:
        raise StaticFileMissing(f"the web page file server/{STATIC_PACKAGE_DIR}/{name} is missing from the "
                                f"installed package ({e})") from None


def _send(resp: falcon.Response, data: bytes, content_type: str) -> None:
    resp.status = falcon.HTTP_200
    resp.content_type = content_type
    for k, v in SECURITY_HEADERS.items():
        resp.set_header(k, v)
    resp.data = data


class PageResource:
    """GET / : the chat page."""
    public = True

    def __init__(self):
        # Read once, at start-up: a package without its page data fails loudly here, not on the first visit.
        self.page = read_static(PAGE_FILE)

    def on_get(self, req, resp) -> None:
        _send(resp, self.page, "text/html; charset=utf-8")


class StaticResource:
    """GET /webui/{name} : the page's script and style sheet (404 for any other name)."""
    public = True

    def __init__(self):
        self.files = {name: (read_static(name), ctype) for name, ctype in STATIC_FILES.items()}

    def on_get(self, req, resp, name: str) -> None:
        entry = self.files.get(name)
        if entry is None:
            raise falcon.HTTPNotFound()
        _send(resp, *entry)


def add_routes(app: falcon.App) -> None:
    app.add_route("/", PageResource())
    app.add_route(STATIC_PREFIX + "/{name}", StaticResource())
