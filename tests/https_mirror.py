"""A real HTTPS file server on loopback, with a certificate made by openssl for the test, and switches to misbehave.

Serves a folder with HTTP Range support. `cut_after[name] = n` makes the next response for that file stop
after n bytes and drop the connection (an interrupted download); every request is logged with its Range.
"""
from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
from pathlib import Path


def make_certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key


class MirrorHandler(http.server.BaseHTTPRequestHandler):
    root: Path
    cut_after: dict
    log: list

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):  # noqa: N802 - http.server's naming
        name = self.path.lstrip("/")
        self.log.append((name, self.headers.get("Range")))
        path = self.root / name
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
            if start >= len(data):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = self.cut_after.pop(name, None)
        if cut is not None:
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


class HttpsMirror:
    """`with HttpsMirror(folder, tmp) as m:` serves folder at m.url, trusted through m.cafile."""

    def __init__(self, root: Path, workdir: Path):
        self.cafile, key = make_certificate(workdir)
        handler = type("Handler", (MirrorHandler,), {"root": root, "cut_after": {}, "log": []})
        self.handler = handler
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cafile, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def log(self) -> list:
        return self.handler.log

    def cut(self, name: str, after: int) -> None:
        self.handler.cut_after[name] = after

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
