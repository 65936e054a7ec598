"""Two deployments on one machine never share a port (issue 51), and a request that reaches a deployment it
was not meant for is refused, not sampled.

Ray Serve's proxy binds with SO_REUSEPORT, so a second Serve on a held port would listen beside the first
and the kernel would split connections between them. art-ray probes the port before Serve starts
(art_ray/serve_port.py), and every app names itself on each response (art_ray/deployment.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO

import httpx
import pytest

from art_ray.deployment import DEPLOYMENT_HEADER, deployment_identity
from art_ray.errors import PortInUseError
from art_ray.serve_port import choose_port, machine_lock, port_holder
from art_ray.serving.endpoint_guard import EndpointGuard

HOST = "127.0.0.1"
DRIVER = Path(__file__).with_name("port_conflict_driver.py")


@contextmanager
def listener(reuse_port: bool = False) -> Iterator[int]:
    """A plain listening socket on a free loopback port; with `reuse_port` bound as Ray Serve's proxy is."""
    sock = socket.socket()
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((HOST, 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# --- the probe ----------------------------------------------------------------------------------------


def test_a_listener_that_would_share_its_port_is_found_and_named() -> None:
    with listener(reuse_port=True) as port:
        # what Serve's proxy does: a second SO_REUSEPORT bind succeeds beside the first
        with socket.socket() as second:
            second.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            second.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            second.bind((HOST, port))
        holder = port_holder(HOST, port)
        assert holder is not None and f"pid {os.getpid()}" in holder
        assert port_holder("0.0.0.0", port) is not None  # a proxy on every address would meet it too
    assert port_holder(HOST, port) is None


def test_a_port_left_in_time_wait_by_an_earlier_server_is_free() -> None:
    """An earlier server's closed connections keep its port in TIME_WAIT for a minute; a plain bind would
    call that port taken, though nothing listens and Serve's own bind succeeds there."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and Serve's proxy do
        server.bind((HOST, 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection((HOST, port)):
            accepted, _ = server.accept()
            accepted.close()  # the server side closes first: it is the side left in TIME_WAIT
            time.sleep(0.1)
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind((HOST, port))  # the TIME_WAIT is there
    assert port_holder(HOST, port) is None


def test_a_port_asked_for_that_is_held_is_an_error_naming_it_its_holder_and_the_way_out() -> None:
    with listener(reuse_port=True) as port, pytest.raises(PortInUseError) as raised:
        choose_port(HOST, port, "RayBackend(port=...)")
    message = str(raised.value)
    assert f"port {port} on {HOST}" in message
    assert f"pid {os.getpid()}" in message
    assert "RayBackend(port=...)" in message
    assert raised.value.port == port


def test_the_default_port_held_gives_way_to_a_free_one_and_says_which() -> None:
    said: list[str] = []
    with listener(reuse_port=True) as default:
        chosen = choose_port(HOST, None, "--port", default=default, say=said.append)
        assert chosen != default
        assert port_holder(HOST, chosen) is None
    assert len(said) == 1
    assert f"port {default} on {HOST} is in use by pid {os.getpid()}" in said[0]
    assert f"Serve listens on port {chosen} instead" in said[0] and "--port" in said[0]


def test_a_free_default_port_is_taken_silently() -> None:
    said: list[str] = []
    with listener() as port:
        pass  # now free
    assert choose_port(HOST, None, "--port", default=port, say=said.append) == port
    assert said == []


def test_the_machine_lock_lets_one_process_start_serve_at_a_time(tmp_path: Path) -> None:
    """Two probes at once would both find the port free; the lock makes the second wait for the first."""
    lock = tmp_path / "serve-start.lock"  # not the machine's: other art-ray processes may hold that one
    events: list[tuple[str, float]] = []
    said: list[str] = []
    first_holds = threading.Event()

    def first() -> None:
        with machine_lock(said.append, str(lock)):
            first_holds.set()
            time.sleep(0.5)
            events.append(("first leaves", time.monotonic()))

    def second() -> None:
        first_holds.wait()
        with machine_lock(said.append, str(lock)):
            events.append(("second enters", time.monotonic()))

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [name for name, _ in events] == ["first leaves", "second enters"]
    assert said == ["art-ray: waiting for another art-ray process on this machine to finish starting Serve"]


def test_the_cli_asks_for_a_port_only_when_given_one() -> None:
    from art_ray.cli import build_parser

    assert build_parser().parse_args(["serve-training"]).port is None  # 8000 if free, else a free one
    assert build_parser().parse_args(["serve-training", "--port", "8001"]).port == 8001  # or an error


# --- the deployment's identity at the endpoint's gate ------------------------------------------------


async def ok_app(scope, receive, send) -> None:  # noqa: ANN001
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": b"{}"})


async def ask(app, path: str, headers: dict[str, str], method: str = "GET") -> httpx.Response:  # noqa: ANN001
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, headers=headers)


async def test_every_answer_names_the_deployment_and_a_request_for_another_is_refused() -> None:
    guard = EndpointGuard(ok_app, api_key="k", deployment="art@session_a")
    key = {"Authorization": "Bearer k"}
    for path, headers in (
        ("/v1/models", key),  # served
        ("/v1/models", {}),  # 401
        ("/tokenize", key),  # 404
    ):
        response = await ask(guard, path, headers)
        assert response.headers[DEPLOYMENT_HEADER] == "art@session_a", (path, response.status_code)
    # asked for by name: served; no name (curl, other clients): served as before
    assert (await ask(guard, "/v1/models", {**key, DEPLOYMENT_HEADER: "art@session_a"})).status_code == 200
    assert (await ask(guard, "/v1/models", key)).status_code == 200
    # meant for another deployment: refused before its routes or keys are judged, naming both
    for headers in ({**key, DEPLOYMENT_HEADER: "art@session_b"}, {DEPLOYMENT_HEADER: "art@session_b"}):
        response = await ask(guard, "/v1/chat/completions", headers, "POST")
        assert response.status_code == 421
        error = response.json()["error"]
        assert error["type"] == "MisdirectedRequestError" and error["code"] == 421
        assert "art@session_b" in error["message"] and "art@session_a" in error["message"]
        assert "one port" in error["message"]
        assert response.headers[DEPLOYMENT_HEADER] == "art@session_a"
    response = await ask(guard, "/v1/messages", {"x-api-key": "k", DEPLOYMENT_HEADER: "x"}, "POST")
    assert response.status_code == 421 and response.json()["type"] == "error"  # Anthropic's shape there


async def test_a_gate_without_an_identity_neither_stamps_nor_checks() -> None:
    response = await ask(EndpointGuard(ok_app, api_key=None), "/v1/models", {DEPLOYMENT_HEADER: "other"})
    assert response.status_code == 200 and DEPLOYMENT_HEADER not in response.headers


# --- the SDK's clients ask for their deployment ------------------------------------------------------


class Recorder(BaseHTTPRequestHandler):
    """A loopback server standing in for a training server and its endpoint: it records each request's
    deployment header and answers as the routes the SDK calls do."""

    seen: list[tuple[str, str | None]] = []
    server_identity = "art-train@session_x"
    inference_identity = "art@session_x"

    def _answer(self) -> None:
        self.seen.append((self.path, self.headers.get(DEPLOYMENT_HEADER)))
        if self.path.endswith("/register"):
            body = {
                "step": 0,
                "inference_path": "/v1",
                "model_dir": "/tmp/m",
                "tracking_uri": None,
                "inference_deployment": self.inference_identity,
            }
        elif self.path.endswith("/step"):
            body = {"step": 0}
        elif self.path.endswith("/models"):
            body = {"object": "list", "data": []}
        else:  # a capture session's turns
            body = {"turns": []}
        payload = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header(DEPLOYMENT_HEADER, self.server_identity)
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802
        self._answer()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer()

    def do_DELETE(self) -> None:  # noqa: N802
        self._answer()

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    Recorder.seen = []
    server = ThreadingHTTPServer((HOST, 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{HOST}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_http_backend_and_its_models_clients_ask_for_the_deployments_they_learned(
    recorder: str,
) -> None:
    from art_ray import HTTPBackend, TrainableModel

    backend = HTTPBackend(recorder, api_key="k")
    model = TrainableModel(name="m", project="p", base_model="tiny")
    await model.register(backend)  # the first request knows no identity yet
    await model.get_step()
    assert model.deployment == backend.deployment == Recorder.inference_identity
    await model.openai_client().models.list()
    async with model.capture() as session:
        await session.openai_client().models.list()
        await session.turns()
    assert Recorder.seen[0] == ("/_art/register", None)
    assert Recorder.seen[1] == ("/_art/step", Recorder.server_identity)
    assert Recorder.seen[2] == ("/v1/models", Recorder.inference_identity)
    assert Recorder.seen[3][0].endswith("/v1/models") and Recorder.seen[3][1] == Recorder.inference_identity
    assert Recorder.seen[4][0].startswith("/v1/capture/sessions/")
    assert Recorder.seen[4][1] == Recorder.inference_identity
    assert Recorder.seen[5][0].startswith("/v1/capture/sessions/")  # the session's close
    assert Recorder.seen[5][1] == Recorder.inference_identity
    assert session.headers[DEPLOYMENT_HEADER] == Recorder.inference_identity


# --- real deployments: two embedded backends at once, and a port asked for that is held -------------


def wait_until(done: Callable[[], bool], drivers: dict, tmp_path: Path, timeout_s: float) -> None:
    """Until `done()`; a driver that exits first fails the test with its output."""
    deadline = time.monotonic() + timeout_s
    while not done():
        for me, (process, _) in drivers.items():
            if process.poll() is not None:
                pytest.fail(f"driver {me} exited:\n" + (tmp_path / f"{me}.log").read_text()[-4000:])
        assert time.monotonic() < deadline, f"not done within {timeout_s:.0f} s"
        time.sleep(0.5)


def test_two_embedded_backends_at_once_each_take_their_own_port_and_answer_only_their_own(
    tmp_path: Path,
) -> None:
    """Two drivers with `RayBackend()`'s defaults, started together (each its own Ray cluster, Serve and
    engine): the second takes a free port and says so, and over 50 requests each (fresh connections too)
    only its own deployment answers. A third driver asking for the first one's port, and for a port a
    plain socket holds, gets PortInUseError naming the port and its holder before anything starts."""
    default_was_free = port_holder(HOST, 8000) is None
    files = {name: tmp_path / f"{name}.json" for name in ("ready_a", "ready_b", "out_a", "out_b", "asked")}
    release, go = tmp_path / "release", tmp_path / "go"
    drivers: dict[str, tuple[subprocess.Popen, IO[str]]] = {}
    finished = False
    try:
        for me, peer in (("a", "b"), ("b", "a")):
            log = open(tmp_path / f"{me}.log", "w")  # noqa: SIM115 - closed with the process below
            command = [
                sys.executable,
                str(DRIVER),
                "serve",
                "--storage",
                str(tmp_path / me),
                "--connected",
                str(tmp_path / f"connected_{me}"),
                "--go",
                str(go),
                "--ready",
                str(files[f"ready_{me}"]),
                "--peer",
                str(files[f"ready_{peer}"]),
                "--release",
                str(release),
                "--out",
                str(files[f"out_{me}"]),
            ]
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
            drivers[me] = (process, log)
            # one Ray cluster starts at a time (two at once time out in Ray itself on two cores); their
            # Serve starts, the moment a port would be shared, are released together below
            wait_until(lambda me=me: (tmp_path / f"connected_{me}").exists(), drivers, tmp_path, 300)
        go.touch()
        wait_until(lambda: files["out_a"].exists() and files["out_b"].exists(), drivers, tmp_path, 900)
        out = {me: json.loads(files[f"out_{me}"].read_text()) for me in drivers}
        with listener() as plain:
            asked = subprocess.run(
                [
                    sys.executable,
                    str(DRIVER),
                    "ask",
                    "--storage",
                    str(tmp_path / "c"),
                    "--out",
                    str(files["asked"]),
                    "--ports",
                    str(out["a"]["port"]),
                    str(plain),
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
        assert asked.returncode == 0, asked.stdout[-3000:] + asked.stderr[-3000:]
        release.touch()
        for process, _ in drivers.values():
            process.wait(timeout=180)
        finished = True
    finally:
        for process, log in drivers.values():
            if not finished and process.poll() is None:  # with its Ray cluster's processes
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            log.close()
    logs = {me: (tmp_path / f"{me}.log").read_text() for me in drivers}
    for me, (process, _) in drivers.items():
        assert process.returncode == 0, logs[me][-4000:]

    # each its own port; the one that found 8000 held said where it went instead
    assert out["a"]["port"] != out["b"]["port"]
    moved = [me for me in drivers if "is in use by" in logs[me]]
    if default_was_free:
        assert sorted(out[me]["port"] for me in drivers if me not in moved) == [8000]
        assert len(moved) == 1
    for me in moved:
        assert f"Serve listens on port {out[me]['port']} instead" in logs[me]
        assert "RayBackend(port=...)" in logs[me]

    # only its own deployment answered each driver, asked for by name or not
    assert out["a"]["deployment"] != out["b"]["deployment"]
    for me, peer in (("a", "b"), ("b", "a")):
        mine = out[me]["deployment"]
        assert mine.startswith("art@session_")
        assert out[me]["with_identity"] == [mine] * 50
        assert out[me]["without_identity"] == [[200, mine]] * 50
        status, body = out[me]["misdirected"]
        assert status == 421
        assert out[peer]["deployment"] in body["error"]["message"] and mine in body["error"]["message"]

    # a port asked for explicitly that another deployment (or any process) holds: a clear error, at once
    outcomes = json.loads(files["asked"].read_text())["outcomes"]
    for outcome, holder in zip(outcomes, ("pid ", f"pid {os.getpid()}"), strict=True):
        assert outcome["raised"] == "PortInUseError", outcome
        assert f"port {outcome['port']} on {HOST} is already in use by {holder}" in outcome["message"]
        assert "RayBackend(port=...)" in outcome["message"]
        assert outcome["seconds"] < 30, outcome


def test_joining_this_clusters_own_serve_is_no_conflict(ray_cluster) -> None:  # noqa: ANN001
    """A Serve already running on the connected cluster is joined even on the port its own proxy holds
    (asked for explicitly or not): only another process's listener is a conflict."""
    from art_ray.serve_deploy import start_serve

    host, port = start_serve(HOST, None)  # starts Serve, or joins the session's
    assert port_holder(host, port) is not None  # its proxy listens there
    assert start_serve(HOST, port) == (host, port)  # asked for explicitly: still this cluster's own
    assert start_serve(HOST, None) == (host, port)
    assert deployment_identity("art") == f"art@{ray_cluster.get_runtime_context().get_session_name()}"


def test_the_training_server_names_itself_and_refuses_requests_meant_for_another(
    ray_cluster,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    from ray import serve

    from art_ray.remote.server import TrainingServerConfig, start_training_server

    config = TrainingServerConfig(storage=str(tmp_path), api_key="k")
    url = start_training_server(config, HOST, None, route_prefix="/_ids", app_name="ids-train")
    try:
        mine, other = deployment_identity("ids-train"), "art-train@session_elsewhere"
        key = {"Authorization": "Bearer k", "Content-Type": "application/json"}

        def step(deployment: str) -> httpx.Response:
            headers = {**key, DEPLOYMENT_HEADER: deployment}
            return httpx.post(f"{url}/_ids/step", json={"model": "nobody"}, headers=headers, timeout=60)

        health = httpx.get(f"{url}/_ids/health", headers=key, timeout=60)
        assert health.status_code == 200 and health.headers[DEPLOYMENT_HEADER] == mine
        asked = step(mine)
        assert asked.status_code == 404 and asked.headers[DEPLOYMENT_HEADER] == mine  # its own: judged
        refused = step(other)
        assert refused.status_code == 421 and refused.headers[DEPLOYMENT_HEADER] == mine
        error = refused.json()["error"]
        assert error["code"] == 421 and other in error["message"] and mine in error["message"]
        misdirected_health = httpx.get(f"{url}/_ids/health", headers={DEPLOYMENT_HEADER: other}, timeout=60)
        assert misdirected_health.status_code == 421
    finally:
        serve.delete("ids-train")
