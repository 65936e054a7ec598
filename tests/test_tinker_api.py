"""The Tinker API's HTTP front (art_ray/tinker/api.py) driven by the real `tinker` SDK, on a uvicorn server
in a thread, over a fake TinkerService; and its parts (the protobuf codec, the future table, the seq_id
lane) against the SDK's own converters."""

from __future__ import annotations

import asyncio
import collections
import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import tinker
import uvicorn
import zstandard
from fastapi import FastAPI
from tinker import types as T
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from art_ray.adapters.spec import validate_model_name
from art_ray.tinker.api import tinker_app
from art_ray.tinker.futures import FutureFailure, FutureTable, UnknownFutureError
from art_ray.tinker.ordering import SeqLane
from art_ray.tinker.principal import Principal, UnknownKeyError
from art_ray.tinker.types import (
    AdamStep,
    ForwardBackwardCall,
    ForwardBackwardResult,
    SampleCall,
    SampledTokens,
    SampleResult,
    SamplerWeights,
    SavedState,
    TinkerModelInfo,
    TinkerModelSpec,
    TinkerUserError,
)
from art_ray.tinker.wire import (
    MalformedForwardBackwardError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)

BASE = "org/tiny-base"
ALICE, BOB, ADMIN = "tml-alice", "tml-bob", "tml-admin"
KEYS = {
    ALICE: Principal(name="alice"),
    BOB: Principal(name="bob", max_concurrent_requests=2),
    ADMIN: Principal(),
}
PROTOBUF = {"Accept": "application/x-protobuf"}


async def authorize(key: str | None) -> Principal:
    if key not in KEYS:
        raise UnknownKeyError("unknown API key")
    return KEYS[key]


class FakeService:
    """Each position's logprob is -0.5 and its loss 0.5 * weight; optim_step counts steps; a sample is the
    tokens 7, 8, 9 (up to max_tokens) with logprob -0.25 each."""

    def __init__(self) -> None:
        self.events: dict[str, list[str]] = collections.defaultdict(list)
        self.running: collections.Counter[str] = collections.Counter()
        self.most_running = 0
        self.steps: collections.Counter[str] = collections.Counter()
        self.specs: list[TinkerModelSpec] = []
        self.samples: list[SampleCall] = []
        self.unloaded: list[str] = []
        self.states: dict[tuple[str, str], SavedState] = {}
        self.hold_samples = False

    async def create_model(self, spec: TinkerModelSpec) -> TinkerModelInfo:
        if spec.lora_rank > 64:
            raise TinkerUserError(f"LoRA rank {spec.lora_rank} is above this server's 64")
        self.specs.append(spec)
        return TinkerModelInfo(
            run=spec.run, base_model=spec.base_model, lora_rank=spec.lora_rank, tokenizer_id=BASE
        )

    async def forward_backward(self, run: str, call: ForwardBackwardCall) -> ForwardBackwardResult:
        self.running[run] += 1
        self.most_running = max(self.most_running, self.running[run])
        await asyncio.sleep(0.01)  # others would get in here if the lane let them
        self.running[run] -= 1
        self.events[run].append(f"{'forward' if call.forward_only else 'fwdbwd'} {call.data[0].tokens[0]}")
        losses = [[0.5 * w for w in (datum.weights or [1.0] * len(datum.tokens))] for datum in call.data]
        return ForwardBackwardResult(
            logprobs=[[-0.5] * len(datum.tokens) for datum in call.data],
            elementwise_loss=losses,
            metrics={"loss:sum": sum(map(sum, losses))},
        )

    async def optim_step(self, run: str, step: AdamStep) -> dict[str, float]:
        self.steps[run] += 1
        self.events[run].append(f"optim lr={step.learning_rate:g}")
        return {"step:max": float(self.steps[run])}

    async def save_for_sampler(self, run: str) -> SamplerWeights:
        step = self.steps[run]
        return SamplerWeights(run=run, step=step, served_name=f"{run}@{step}")

    async def save_state(self, run: str, name: str) -> SavedState:
        spec = next(spec for spec in self.specs if spec.run == run)
        state = SavedState(
            run=run,
            name=name,
            step=self.steps[run],
            base_model=spec.base_model,
            lora_rank=spec.lora_rank,
            owner=spec.owner,
        )
        self.states[(run, name)] = state
        return state

    async def saved_state(self, run: str, name: str) -> SavedState | None:
        return self.states.get((run, name))

    async def load_state(self, run: str, state: SavedState, optimizer: bool) -> int:
        self.steps[run] = state.step
        self.events[run].append(f"load {state.run}/{state.name} optimizer={optimizer}")
        return state.step

    async def sample(self, call: SampleCall) -> SampleResult:
        while self.hold_samples:
            await asyncio.sleep(0.01)
        self.samples.append(call)
        tokens = [7, 8, 9][: call.max_tokens or 3]
        sequence = SampledTokens(tokens=tokens, logprobs=[-0.25] * len(tokens), stop_reason="length")
        prompt_logprobs = [None, *[-1.0] * (len(call.prompt) - 1)] if call.prompt_logprobs else None
        return SampleResult(sequences=[sequence] * call.num_samples, prompt_logprobs=prompt_logprobs)

    async def unload(self, run: str) -> None:
        self.unloaded.append(run)


@dataclass
class Server:
    url: str
    service: FakeService

    def post(self, route: str, body: object, key: str = ALICE, **kwargs: object) -> httpx.Response:
        headers = {"X-API-Key": key, **kwargs.pop("headers", {})}  # type: ignore[dict-item]
        return httpx.post(f"{self.url}/api/v1/{route}", json=body, headers=headers, timeout=10, **kwargs)

    def get(self, route: str, key: str = ALICE) -> httpx.Response:
        return httpx.get(f"{self.url}/api/v1/{route}", headers={"X-API-Key": key}, timeout=10)

    def retrieve(self, request_id: str, key: str = ALICE) -> httpx.Response:
        return self.post("retrieve_future", {"request_id": request_id}, key, headers=PROTOBUF)

    def client(self, key: str = ALICE) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=key)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    service = FakeService()
    parent = FastAPI()
    parent.mount("/api/v1", tinker_app(service, authorize, [BASE], futures=FutureTable(poll_s=2.0)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uvicorn_server = uvicorn.Server(uvicorn.Config(parent, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, daemon=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TINKER_TELEMETRY", "0")
        thread.start()
        while not uvicorn_server.started:
            time.sleep(0.02)
        yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", service)
        uvicorn_server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def alice(server: Server) -> Iterator[tinker.ServiceClient]:
    client = server.client(ALICE)
    yield client
    client.close("success").result(timeout=10)


def datum(tokens: list[int], weights: list[float] | None = None) -> T.Datum:
    """As the cookbook builds them: position i of the input predicts token i + 1."""
    inputs: dict[str, list] = {"target_tokens": tokens[1:]}
    if weights is not None:
        inputs["weights"] = weights
    return T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def fwdbwd_body(model_id: str, seq_id: int, data: list[T.Datum], loss_fn: str = "cross_entropy") -> bytes:
    request = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=data, loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_training_loop_runs_unchanged_through_the_sdk(server: Server, alice: tinker.ServiceClient) -> None:
    training = alice.create_lora_training_client(
        BASE, rank=8, user_metadata={"renderer": "role_colon"}
    ).result()
    info = training.get_info()
    assert (info.model_data.model_name, info.lora_rank, info.model_data.tokenizer_id) == (BASE, 8, BASE)
    spec = server.service.specs[-1]
    assert (spec.run, spec.lora_rank, spec.owner) == (training.model_id.replace(":", "-"), 8, "alice")
    assert validate_model_name(spec.run)

    data = [datum([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1]), datum([20, 21, 22], [1, 1])]
    fwdbwd = training.forward_backward(data, "cross_entropy")
    optim = training.optim_step(T.AdamParams(learning_rate=1e-3))
    forward = training.forward(data, "cross_entropy")
    output = fwdbwd.result()
    assert [out["logprobs"].tolist() for out in output.loss_fn_outputs] == [[-0.5] * 5, [-0.5] * 2]
    assert output.loss_fn_outputs[0]["elementwise_loss"].tolist() == [0, 0, 0.5, 0.5, 0.5]
    assert output.metrics == {"loss:sum": 2.5}
    assert optim.result().metrics == {"step:max": 1.0}
    assert len(forward.result().loss_fn_outputs) == 2
    assert server.service.events[spec.run] == ["fwdbwd 1", "optim lr=0.001", "forward 1"]

    sampler = training.save_weights_and_get_sampling_client().result()
    params = T.SamplingParams(max_tokens=2, temperature=0.7, stop=["\n"], seed=3)
    response = sampler.sample(T.ModelInput.from_ints([1, 2, 3]), 2, params).result()
    assert [sequence.tokens for sequence in response.sequences] == [[7, 8], [7, 8]]
    assert response.sequences[0].logprobs == pytest.approx([-0.25, -0.25])
    assert len({sequence.sequence_id for sequence in response.sequences}) == 2
    call = server.service.samples[-1]
    assert (call.model, call.prompt, call.num_samples, call.stop, call.seed) == (
        f"{spec.run}@1",
        [1, 2, 3],
        2,
        ["\n"],
        3,
    )
    assert sampler.compute_logprobs(T.ModelInput.from_ints([5, 6, 7])).result() == [None, -1.0, -1.0]
    assert sampler.compute_logprobs(T.ModelInput.from_ints([5, 6, 7]), prompt_logprobs_last_n=1).result() == [
        None,
        None,
        -1.0,
    ]

    training.optim_step(T.AdamParams()).result()
    path = training.save_weights_for_sampler("final").result().path
    assert path == f"tinker://{training.model_id}/sampler_weights/final"
    by_path = alice.create_sampling_client(model_path=path).result()
    assert by_path.get_base_model() == BASE  # from GET samplers/{id}
    by_path.sample(T.ModelInput.from_ints([1]), 1, T.SamplingParams(max_tokens=1)).result()
    assert server.service.samples[-1].model == f"{spec.run}@2"
    base = alice.create_sampling_client(base_model=BASE).result()
    base.sample(T.ModelInput.from_ints([1]), 1, T.SamplingParams(max_tokens=1)).result()
    assert server.service.samples[-1].model == BASE

    rest = tinker.RestClient(base_url=server.url, api_key=ALICE)
    assert training.model_id in [
        run.training_run_id for run in rest.list_training_runs().result().training_runs
    ]
    run = rest.get_training_run(training.model_id).result()
    assert (run.base_model, run.lora_rank, run.user_metadata) == (BASE, 8, {"renderer": "role_colon"})
    checkpoints = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.tinker_path) for c in checkpoints] == [("sampler_weights/final", path)]
    capabilities = rest.get_server_capabilities().result()
    assert [model.model_name for model in capabilities.supported_models] == [BASE]


def test_a_models_requests_run_one_at_a_time_in_seq_id_order(
    server: Server, alice: tinker.ServiceClient
) -> None:
    training = alice.create_lora_training_client(BASE, rank=4).result()
    run = training.model_id.replace(":", "-")
    # seq_id 3, then 2, then 1: as the SDK sends a forward_backward's chunks (the first one last)
    request_ids = {}
    for seq_id in (3, 2, 1):
        body = fwdbwd_body(training.model_id, seq_id, [datum([100 + seq_id, 1, 2])])
        reply = server.post(
            "forward_backward", None, content=body, headers={"Content-Type": "application/x-protobuf"}
        )
        request_ids[seq_id] = reply.json()["request_id"]
    again = server.post(
        "forward_backward", None, content=fwdbwd_body(training.model_id, 2, [datum([102, 1, 2])])
    ).json()
    assert again == {"request_id": request_ids[2], "model_id": training.model_id, "sample_sequence_ids": None}
    for request_id in request_ids.values():
        output = deserialize_forward_backward_output(server.retrieve(request_id).content)
        assert output.metrics == {"loss:sum": 1.0}
    assert server.service.events[run] == ["fwdbwd 101", "fwdbwd 102", "fwdbwd 103"]
    assert server.service.most_running == 1


def test_a_second_key_sees_nothing_of_the_first(server: Server, alice: tinker.ServiceClient) -> None:
    training = alice.create_lora_training_client(BASE, rank=4).result()
    model_id = training.model_id
    path = training.save_weights_for_sampler("mine").result().path
    sampler_id = server.post(
        "create_sampling_session",
        {"session_id": model_id.split(":")[0], "sampling_session_seq_id": 900, "model_path": path},
    ).json()["sampling_session_id"]
    future = server.post("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {}}).json()
    assert server.retrieve(future["request_id"]).json() == {"metrics": {"step:max": 1.0}}

    for reply in [
        server.post("get_info", {"model_id": model_id}, BOB),
        server.post("optim_step", {"model_id": model_id, "seq_id": 3, "adam_params": {}}, BOB),
        server.get(f"samplers/{sampler_id}", BOB),
        server.retrieve(future["request_id"], BOB),
        server.get(f"training_runs/{model_id}", BOB),
        server.get(f"training_runs/{model_id}/checkpoints", BOB),
        server.post(
            "create_model",
            {"session_id": model_id.split(":")[0], "model_seq_id": 99, "base_model": BASE},
            BOB,
        ),
    ]:
        assert reply.status_code == 404, reply.text
    assert server.post("session_heartbeat", {"session_id": model_id.split(":")[0]}, BOB).status_code == 410
    assert model_id not in [
        run["training_run_id"] for run in server.get("training_runs", BOB).json()["training_runs"]
    ]
    assert server.post("get_info", {"model_id": model_id}, ADMIN).json()["model_id"] == model_id

    with server.client(BOB) as bob:
        started = time.monotonic()
        with pytest.raises(tinker.NotFoundError, match="no model"):
            bob.create_sampling_client(model_path=path).result()
        assert time.monotonic() - started < 5


def test_bad_requests_fail_at_once_with_what_to_change(server: Server, alice: tinker.ServiceClient) -> None:
    started = time.monotonic()
    with pytest.raises(
        tinker.RequestFailedError, match="base model 'nope' is not served here: use one of org/tiny"
    ):
        alice.create_lora_training_client("nope").result()
    with pytest.raises(tinker.RequestFailedError, match="LoRA rank 128 is above"):
        alice.create_lora_training_client(BASE, rank=128).result()
    training = alice.create_lora_training_client(BASE, rank=4).result()
    mismatched = T.Datum(
        model_input=T.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3]}
    )
    with pytest.raises(tinker.RequestFailedError, match=r"'target_tokens'\] has 2 values for 3 tokens"):
        training.forward_backward([mismatched], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn 'stable_reinforce' is not supported"):
        training.forward_backward([datum([1, 2, 3])], "stable_reinforce").result()
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_inputs logprobs, advantages"):
        training.forward_backward([datum([1, 2, 3])], "importance_sampling").result()
    with pytest.raises(tinker.RequestFailedError, match="art-ray's optimizer is Adam"):
        training.optim_step(T.DimuonParams(learning_rate=0.1)).result()
    with pytest.raises(tinker.RequestFailedError, match="checkpoint name 'a/b'"):
        training.save_state("a/b").result()
    # the refused requests took their turns: the next one runs
    assert training.forward_backward([datum([1, 2, 3])], "cross_entropy").result().metrics == {
        "loss:sum": 1.0
    }
    sampler = training.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.RequestFailedError, match="topk_prompt_logprobs is not served"):
        sampler.sample(T.ModelInput.from_ints([1]), 1, T.SamplingParams(), topk_prompt_logprobs=2).result()
    with pytest.raises(tinker.NotFoundError, match="base model 'nope' is not served"):
        alice.create_sampling_client(base_model="nope").result()
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-nobody").create_lora_training_client(BASE)
    assert time.monotonic() - started < 10  # no request sat in the SDK's retries


def test_a_keys_sampling_beyond_its_limit_is_answered_429(
    server: Server, alice: tinker.ServiceClient
) -> None:
    session_id = server.post("create_session", {}, BOB).json()["session_id"]
    sampler = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE}
    sampler_id = server.post("create_sampling_session", sampler, BOB).json()["sampling_session_id"]
    body = {
        "sampling_session_id": sampler_id,
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"tokens": [1]}]},
    }
    body["sampling_params"] = {"max_tokens": 1}
    server.service.hold_samples = True
    try:
        held = [server.post("asample", body, BOB) for _ in range(2)]
        assert [reply.status_code for reply in held] == [200, 200]
        assert server.post("asample", body, BOB).status_code == 429  # bob may have 2 in flight
        assert (
            server.post("create_sampling_session", {**sampler, "sampling_session_seq_id": 1}, BOB).status_code
            == 200
        )
    finally:
        server.service.hold_samples = False
    for reply in held:
        assert deserialize_sample_response(server.retrieve(reply.json()["request_id"], BOB).content).sequences
    assert server.post("asample", body, BOB).status_code == 200


async def test_sessions_end_without_heartbeats_or_when_finished_and_unload_their_models() -> None:
    service = FakeService()
    app = tinker_app(service, authorize, [BASE], session_ttl_s=0.3, futures=FutureTable(poll_s=1.0))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://front", headers={"X-API-Key": ALICE}
    ) as http:

        async def call(route: str, body: dict) -> httpx.Response:
            return await http.post(route, json=body)

        async def new_model(session_id: str, model_seq_id: int) -> str:
            body = {"session_id": session_id, "model_seq_id": model_seq_id, "base_model": BASE}
            future = (await call("/create_model", body)).json()
            assert (await call("/retrieve_future", future)).json()["model_id"] == future["model_id"]
            return future["model_id"]

        kept, lapsed = [(await call("/create_session", {})).json()["session_id"] for _ in range(2)]
        unloaded, finished, lapsed_model = [
            await new_model(kept, 0),
            await new_model(kept, 1),
            await new_model(lapsed, 0),
        ]
        for _ in range(6):
            await asyncio.sleep(0.1)
            assert (await call("/session_heartbeat", {"session_id": kept})).status_code == 200
        assert service.unloaded == [lapsed_model.replace(":", "-")]
        assert (await call("/session_heartbeat", {"session_id": lapsed})).status_code == 410
        assert (await call("/get_info", {"model_id": lapsed_model})).status_code == 404
        assert (await call("/get_info", {"model_id": unloaded})).status_code == 200

        future = (await call("/unload_model", {"model_id": unloaded})).json()
        assert (await call("/retrieve_future", future)).json() == {
            "model_id": unloaded,
            "type": "unload_model",
        }
        assert (await call("/get_info", {"model_id": unloaded})).status_code == 404
        assert (await call(f"/sessions/{kept}/finish", {"reason": {"type": "success"}})).status_code == 200
        await asyncio.sleep(0.05)
        assert service.unloaded == [run.replace(":", "-") for run in (lapsed_model, unloaded, finished)]
        assert (await call(f"/sessions/{kept}/finish", {})).status_code == 200  # already finished: no error
        assert (await call("/session_heartbeat", {"session_id": kept})).status_code == 410


def test_forward_backward_bodies_decode_as_the_sdk_encodes_them() -> None:
    inputs = {
        "target_tokens": [2, 3, 4],
        "weights": [0.0, 1.0, 0.5],
        "logprobs": [-1.0] * 3,
        "advantages": [1.0] * 3,
    }
    data = [
        T.Datum(model_input=T.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=inputs),
        T.Datum(
            model_input=T.ModelInput.from_ints([9, 8]),
            loss_fn_inputs={"target_tokens": [8, 7], "logprobs": [-1.0, -2.0], "advantages": [0.5, -0.5]},
        ),
    ]
    request = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(
            data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8}
        ),
        model_id="s:train:0",
        seq_id=7,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    body = message.SerializeToString()
    for encoded, encoding in [(body, None), (zstandard.ZstdCompressor().compress(body), "zstd")]:
        model_id, seq_id, call = decode_forward_backward(encoded, encoding)
        assert (model_id, seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", True)
        assert call.loss_fn_config == pytest.approx({"clip_low_threshold": 0.8})
        assert call.data[0].model_dump() == {"tokens": [1, 2, 3], **inputs}
        assert (call.data[1].logprobs, call.data[1].advantages) == ([-1.0, -2.0], [0.5, -0.5])

    two_d = T.Datum(
        model_input=T.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={
            "target_tokens": T.TensorData(
                data=[5, 6],
                dtype="int64",
                shape=[2, 4],
                sparse_crow_indices=[0, 1, 2],
                sparse_col_indices=[0, 3],
            )
        },
    )
    with pytest.raises(MalformedForwardBackwardError, match=r"shape \[2, 4\]: art-ray takes 1-D") as refused:
        decode_forward_backward(fwdbwd_body("s:train:1", 3, [two_d]), None)
    assert (refused.value.model_id, refused.value.seq_id) == ("s:train:1", 3)
    with pytest.raises(MalformedForwardBackwardError, match="not protobuf") as garbage:
        decode_forward_backward(b"\xff\xff\xff", None)
    assert garbage.value.model_id is None


def test_outputs_decode_with_the_sdks_converters() -> None:
    result = ForwardBackwardResult(
        logprobs=[[-0.5, -1.5, -2.5], [-3.0]],
        elementwise_loss=[[0.5, 1.5, 2.5], [3.0]],
        metrics={"loss:sum": 7.5},
    )
    output = deserialize_forward_backward_output(encode_forward_backward_output(result))
    assert output.loss_fn_output_type == "ArrayRecord"
    assert [out["logprobs"].tolist() for out in output.loss_fn_outputs] == result.logprobs
    assert [out["elementwise_loss"].shape for out in output.loss_fn_outputs] == [[3], [1]]
    assert output.metrics == {"loss:sum": 7.5}

    sampled = SampleResult(
        sequences=[
            SampledTokens(tokens=[4, 5], logprobs=[-0.1, -0.2], stop_reason="stop"),
            SampledTokens(tokens=[6], logprobs=[-0.3], stop_reason="length"),
        ],
        prompt_logprobs=[None, -0.75],
    )
    response = deserialize_sample_response(encode_sample_response(sampled))
    assert [(s.tokens, s.stop_reason) for s in response.sequences] == [([4, 5], "stop"), ([6], "length")]
    assert response.sequences[0].logprobs == pytest.approx([-0.1, -0.2])
    assert math.isnan(response.prompt_logprobs_np[0]) and response.prompt_logprobs == [None, -0.75]
    assert np.isclose(response.prompt_logprobs_np[1], -0.75)


async def test_futures_are_the_owners_and_dropped_after_they_are_read() -> None:
    now = [0.0]
    table = FutureTable(poll_s=0.05, keep_retrieved_s=60.0, keep_unretrieved_s=600.0, clock=lambda: now[0])
    alice, bob = Principal(name="alice"), Principal(name="bob")
    release = asyncio.Event()

    async def slow() -> T.OptimStepResponse:
        await release.wait()
        return T.OptimStepResponse(metrics={})

    async def refused() -> bytes:
        raise TinkerUserError("change this")

    async def broken() -> bytes:
        raise RuntimeError("disk full")

    pending = table.submit("alice", slow())
    assert await table.retrieve(pending, alice) is None  # still running: try again
    with pytest.raises(UnknownFutureError):
        await table.retrieve(pending, bob)
    release.set()
    assert await table.retrieve(pending, Principal()) == T.OptimStepResponse(metrics={})  # the admin key
    assert await table.retrieve(table.submit(None, refused()), Principal()) == FutureFailure(
        message="change this", category="user"
    )
    assert await table.retrieve(table.submit(None, broken()), Principal()) == FutureFailure(
        message="RuntimeError: disk full", category="server"
    )
    unread = table.submit("alice", refused())
    await asyncio.sleep(0)
    now[0] = 61.0
    assert await table.retrieve(unread, alice) is not None  # unread results live longer
    with pytest.raises(UnknownFutureError):
        await table.retrieve(pending, alice)


async def test_a_closed_lane_fails_its_waiting_requests() -> None:
    lane = SeqLane()
    finished: list[int] = []

    async def step(seq_id: int) -> int:
        await asyncio.sleep(0.01)
        finished.append(seq_id)
        return seq_id

    third = asyncio.create_task(lane.run(3, lambda: step(3)))
    first = asyncio.create_task(lane.run(1, lambda: step(1)))
    await asyncio.sleep(0)
    await lane.close("session ended")
    assert await first == 1  # it was running: it finishes
    with pytest.raises(TinkerUserError, match="session ended"):
        await third
    with pytest.raises(TinkerUserError, match="seq_id 1 was already used"):
        await lane.run(1, lambda: step(1))
    assert finished == [1]


def test_training_state_is_saved_loaded_and_made_into_new_clients_by_its_owner_only(
    server: Server, alice: tinker.ServiceClient
) -> None:
    training = alice.create_lora_training_client(BASE, rank=16).result()
    run = training.model_id.replace(":", "-")
    training.optim_step(T.AdamParams()).result()
    path = training.save_state("after-one").result().path
    assert path == f"tinker://{training.model_id}/weights/after-one"
    training.optim_step(T.AdamParams()).result()
    training.load_state(path).result()
    training.load_state_with_optimizer(path).result()
    assert server.service.events[run][-2:] == [
        f"load {run}/after-one optimizer=False",
        f"load {run}/after-one optimizer=True",
    ]
    copy = alice.create_training_client_from_state_with_optimizer(path).result()
    assert copy.model_id != training.model_id and copy.get_info().lora_rank == 16
    copied = copy.model_id.replace(":", "-")
    assert server.service.events[copied] == [f"load {run}/after-one optimizer=True"]
    rest = tinker.RestClient(base_url=server.url, api_key=ALICE)
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [("training", path)]

    bob = server.client(BOB)  # another key: the state is not there for it
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(f"tinker://{training.model_id}/weights/never-saved").result()
    bob.close("success").result(timeout=10)


def test_the_document_lists_every_served_route_behind_the_key(server: Server) -> None:
    from art_ray.tinker.openapi import ANSWERS

    assert server.get("openapi.json", key="tml-unknown").status_code == 401
    document = server.get("openapi.json").json()
    assert set(document["paths"]) == set(ANSWERS)  # the catch-all 404 is not a route of its own
    sample = document["paths"]["/asample"]["post"]
    assert sample["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/Sample")
    assert sample["responses"]["200"]["links"]["RetrieveFuture"]["operationId"] == "retrieve_future"
    assert not any(  # the key is a security scheme, not a parameter to generate
        parameter["in"] == "header"
        for operations in document["paths"].values()
        for operation in operations.values()
        for parameter in operation.get("parameters", [])
    )
    assert (
        server.post(
            "asample", {"prompt": {"chunks": []}, "sampling_params": {}, "num_samples": 129}
        ).status_code
        == 422
    )


FOUND = [  # what fuzzing found, each answered since with a 422 in FastAPI's {"detail": ...}
    ("save_weights_external", b'{"model_id": null, "seq_id": false}'),  # false was read as seq_id 0
    ("optim_step", b'{"model_id": "m", "seq_id": true}'),
    ("get_info", b".\x8e\x10C"),  # not UTF-8: FastAPI's 400, which the SDK retries for minutes
]


@pytest.mark.parametrize(("route", "body"), FOUND)
def test_what_fuzzing_found_is_refused(server: Server, route: str, body: bytes) -> None:
    headers = {"X-API-Key": ALICE, "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}/api/v1/{route}", content=body, headers=headers, timeout=10)
    assert response.status_code == 422, response.text
    assert response.json()["detail"]


def test_a_bounded_fuzz_run_of_the_front_finds_nothing(server: Server) -> None:
    """bench/fuzz.py's requests from the document, against the front over the fake service: every
    route's validation, ownership and futures; the deployed API is fuzzed by the bench."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    import fuzz

    report = fuzz.fuzz_api(f"{server.url}/api/v1", {"X-API-Key": ALICE}, None, max_examples=8, timeout_s=20)
    failures = "\n".join(
        f"{f.kind} {f.operation} {f.status}: {f.message}\n  {f.curl}" for f in report.findings
    )
    assert report.findings == [], failures
    assert len(report.by_operation) == 24 and report.requests >= 300
