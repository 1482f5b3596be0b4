"""``vkv view``: a page that shows a recording of the KV cache (``vkv.recording``).

The page (``index.html``, ``view.js``, ``view.css``: no CDN, nothing from the network) is served
on 127.0.0.1 with the recording as ``recording.jsonl``. A recording is a file (``vkv view
RUN.jsonl``: read again on each request) or a ``LiveRecording`` that a running engine feeds
(``vkv demo --web``, ``vkv serve --view-port``): then the answer carries ``X-VKV-Live: 1`` and
``/events?after=N`` streams each step numbered above N as a Server-Sent Event (``id``: the step
number, ``data``: its line), with a comment every second while nothing happens. The page checks
what it reads and shows a corrupt or truncated recording as an error; ``vkv view`` checks a
file before serving it and refuses it with the same message on the command line.
"""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from vkv.recording import LiveRecording

ASSETS = Path(__file__).parent
PAGES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/view.js": ("view.js", "text/javascript; charset=utf-8"),
    "/view.css": ("view.css", "text/css; charset=utf-8"),
    "/recording.schema.json": ("recording.schema.json", "application/json"),
}


class ViewServer:
    """The page and ``source`` (a recording's path, or a ``LiveRecording``) over HTTP on
    ``host:port`` (port 0: any free one). ``with ViewServer(...)`` serves from a thread."""

    def __init__(
        self, source: str | Path | LiveRecording, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.source = source if isinstance(source, LiveRecording) else Path(source)
        self.closing = threading.Event()
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.url = f"http://{host}:{self.httpd.server_address[1]}/"

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def start(self) -> "ViewServer":
        """Serve from a daemon thread; return self."""
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """End the event streams, stop serving and close the socket."""
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "ViewServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlparse(self.path)
                live = isinstance(server.source, LiveRecording)
                if url.path == "/events" and live:
                    self._stream(server.source, parse_qs(url.query).get("after", ["0"])[0])
                    return
                if url.path == "/recording.jsonl":
                    text = server.source.text() if live else server.source.read_text("utf-8")
                    body, kind = text.encode(), "application/jsonl; charset=utf-8"
                elif url.path in PAGES:
                    name, kind = PAGES[url.path]
                    body = (ASSETS / name).read_bytes()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                if live and url.path == "/recording.jsonl":
                    self.send_header("X-VKV-Live", "1")
                self.end_headers()
                self.wfile.write(body)

            def _stream(self, recording: LiveRecording, after: str) -> None:
                step = int(after) if after.isdigit() else 0
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                try:
                    while not server.closing.is_set():
                        lines = recording.after(step, timeout=1.0)
                        for step, line in lines:
                            self.wfile.write(f"id: {step}\ndata: {line}\n\n".encode())
                        if not lines:
                            self.wfile.write(b": waiting for the next step\n\n")
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the page went away

            def log_message(self, *args) -> None:
                pass

        return Handler
