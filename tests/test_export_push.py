"""`meshlm export --push-to-hub REPO` against a stand-in for the Hugging Face Hub on 127.0.0.1 (huggingface_hub's
HF_ENDPOINT pointed at an HTTP server this test starts; nothing reaches the network): the files the hub receives are
the export's, byte for byte; offline, the refusal is one line and the export stays on disk."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import run_meshlm


class Hub:
    """The endpoints create_repo and upload_folder call: every file is answered "regular" (sent inline in the
    commit), so neither LFS nor Xet transfers are needed; what else is asked is recorded in `unknown`."""

    def __init__(self):
        self.repos, self.files, self.unknown = set(), {}, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                hub.unknown.append(("GET", self.path))
                self.reply(404, {"error": "not here"})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:3] == ["api", "repos", "create"]:
                    req = json.loads(body)
                    name = (
                        f"{req.get('organization') or 'user'}/{req['name']}" if "/" not in req["name"] else req["name"]
                    )
                    hub.repos.add(name)
                    return self.reply(200, {"url": f"{hub.url}/{name}", "name": name})
                if parts[:2] == ["api", "models"] and "preupload" in parts:
                    files = json.loads(body)["files"]
                    return self.reply(
                        200,
                        {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
                    )
                if parts[:2] == ["api", "models"] and "commit" in parts:
                    repo = "/".join(parts[2 : parts.index("commit")])
                    for line in body.decode().splitlines():
                        op = json.loads(line)
                        if op["key"] == "file":
                            hub.files[(repo, op["value"]["path"])] = base64.b64decode(op["value"]["content"])
                    return self.reply(200, {"commitUrl": f"{hub.url}/{repo}/commit/" + "1" * 40, "commitOid": "1" * 40})
                hub.unknown.append(("POST", self.path))
                self.reply(404, {"error": "not here"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub():
    h = Hub()
    yield h
    h.close()


def _push(single_run, out, hub_url: str, offline: str):
    env = {
        "HF_ENDPOINT": hub_url,
        "HF_TOKEN": "hf_stand_in",
        "HF_HUB_OFFLINE": offline,
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    return run_meshlm(
        "export", "--checkpoint", single_run, "--out", out, "--push-to-hub", "me/tiny", env=env, check=False
    )


def test_the_hub_receives_the_export(single_run, tmp_path, hub):
    out = tmp_path / "hf"
    p = _push(single_run, out, hub.url, "0")
    assert p.returncode == 0, p.stderr
    assert f"pushed to {hub.url}/me/tiny/commit/" in p.stdout, p.stdout
    local = {str(f.relative_to(out)): f.read_bytes() for f in out.rglob("*") if f.is_file()}
    assert hub.repos == {"me/tiny"} and "model.safetensors" in local and "config.json" in local
    assert {name: data for (repo, name), data in hub.files.items()} == local
    assert not hub.unknown, hub.unknown


def test_offline_the_push_is_one_line_and_the_export_stays(single_run, tmp_path, hub):
    out = tmp_path / "hf"
    p = _push(single_run, out, hub.url, "1")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("meshlm: error: --push-to-hub me/tiny: ") and f"the export is in {out}" in lines[0]
    assert (out / "model.safetensors").is_file() and not hub.files
