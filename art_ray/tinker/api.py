"""The Tinker API's HTTP front: the routes the `tinker` SDK (0.38) calls, relative to the /api/v1 prefix
it is deployed at, with the bodies its resources/ and proto/ send and read. The work behind them is a
TinkerService.

Sessions, models, samplers, checkpoints and futures are bound to the key name that made them: a run key
sees its own, and anything else is answered exactly as an unknown id; the admin key sees everything. All
of it lives in this process, so the app runs as one replica.

How the SDK reads an answer decides how each failure is sent. A user error is a failed future with
category "user" (raised as RequestFailedError, never retried), or a 404/406/422 (raised at once); a 429
it backs off and resends; a 5xx, 408 or 409 it resends for minutes, so none is used for an error of the
client's; and a bare 400 it retries on retrieve_future.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Annotated, TypeVar

import pydantic
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from tinker import types as sdk
from tinker.types.try_again_response import TryAgainResponse

from art_ray.tinker import bodies
from art_ray.tinker.futures import FutureFailure, FutureResult, FutureTable, UnknownFutureError
from art_ray.tinker.openapi import tinker_openapi
from art_ray.tinker.ordering import SeqLane
from art_ray.tinker.principal import Principal, UnknownKeyError
from art_ray.tinker.types import (
    AdamStep,
    ForwardBackwardCall,
    SampleCall,
    SavedState,
    TinkerModelInfo,
    TinkerModelSpec,
    TinkerRunStatus,
    TinkerService,
    TinkerUserError,
)
from art_ray.tinker.wire import (
    MalformedForwardBackwardError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
Authorize = Callable[[str | None], Awaitable[Principal]]

PROTOBUF = "application/x-protobuf"
TINKER_PATH_PREFIX = "tinker://"
# The SDK's switches (tinker/types/client_config_response.py): API keys, no JWT exchange; one
# retrieve_future poll per request; httpx's own transport, the one this front is tested with; custom
# losses run client-side; an unpickled SamplingClient picks its own seq_id block.
CLIENT_CONFIG = sdk.ClientConfigResponse(
    pjwt_auth_enabled=False,
    proto_compress_fwdbwd=False,
    use_pyqwest_transport=False,
    sample_use_retrieve_futures=False,
    custom_loss_server_side=False,
    sample_join_sampling_session=False,
)
UNSERVED_EXTERNAL_WEIGHTS = (
    "save_weights_external is not served by art-ray's Tinker API: save_state keeps the training state, "
    "save_weights_for_sampler the weights to sample"
)


def run_name(model_id: str) -> str:
    """The art-ray run of a Tinker model: its id (`{session_id}:train:{n}`, a session id being letters and
    digits) with '-' for ':', a valid art-ray model name."""
    return model_id.replace(":", "-")


def sampler_weights_path(model_id: str, name: str) -> str:
    return f"{TINKER_PATH_PREFIX}{model_id}/sampler_weights/{name}"


def weights_path(model_id: str, name: str) -> str:
    """Where save_state keeps a training state (adapter, optimizer state, step)."""
    return f"{TINKER_PATH_PREFIX}{model_id}/weights/{name}"


def _checkpoint_path(path: str, kind: str) -> tuple[str, str]:
    """(model_id, name) of `tinker://<model_id>/<kind>/<name>`; a 404 for any other path."""
    model_id, _, rest = path.removeprefix(TINKER_PATH_PREFIX).partition("/")
    found, _, name = rest.partition("/")
    if not path.startswith(TINKER_PATH_PREFIX) or found != kind or not model_id or not name or "/" in name:
        raise HTTPException(404, f"nothing at {path!r}: expected tinker://<model_id>/{kind}/<name>")
    return model_id, name


def _checkpoint_name(name: str | None) -> str:
    if not name or "/" in name:
        raise TinkerUserError(f"checkpoint name {name!r}: give a non-empty name without '/'")
    return name


def _now() -> datetime:
    return datetime.now(UTC)


def _json(reply: pydantic.BaseModel) -> JSONResponse:
    return JSONResponse(reply.model_dump(mode="json"))


def _invalid(error: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in e['loc']) or 'value'}: {e['msg']}"
        for e in error.errors(include_url=False)
    )


async def _caller(request: Request, x_api_key: Annotated[str | None, Header()] = None) -> Principal:
    """The caller as the app's `authorize` judges its X-API-Key header."""
    authorize: Authorize = request.app.state.authorize
    try:
        return await authorize(x_api_key)
    except UnknownKeyError as error:
        raise HTTPException(401, str(error) or "missing or unknown API key: send X-API-Key") from None


Caller = Annotated[Principal, Depends(_caller)]


@dataclass
class _Session:
    session_id: str
    owner: str | None
    last_heartbeat: float
    model_ids: list[str] = field(default_factory=list)
    sampler_ids: list[str] = field(default_factory=list)


@dataclass
class _Checkpoint:
    name: str
    served_name: str
    time: datetime


@dataclass
class _Model:
    """A training client's model, with its named sampler checkpoints; dropped when it is unloaded (its
    session ended), as the service then drops its run."""

    model_id: str
    session_id: str
    owner: str | None
    base_model: str
    lora_rank: int
    user_metadata: dict[str, str]
    lane: SeqLane = field(default_factory=SeqLane)
    create_request_id: str | None = None
    info: TinkerModelInfo | None = None  # set once the service made it
    ended: bool = False
    last_request_time: datetime = field(default_factory=_now)
    checkpoints: dict[str, _Checkpoint] = field(default_factory=dict)
    states: dict[str, _Checkpoint] = field(default_factory=dict)  # save_state's, by name

    @property
    def run(self) -> str:
        return run_name(self.model_id)


@dataclass
class _Sampler:
    sampler_id: str
    owner: str | None
    base_model: str
    served_name: str  # what the engines sample: the base model or a snapshot's `run@step`
    model_path: str | None


class _Front:
    def __init__(
        self,
        service: TinkerService,
        served_base_models: Collection[str],
        session_ttl_s: float,
        futures: FutureTable,
    ) -> None:
        self.service = service
        self.served_base_models = tuple(served_base_models)
        self.session_ttl_s = session_ttl_s
        self.futures = futures
        self.sessions: dict[str, _Session] = {}
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, _Sampler] = {}
        self.in_flight: collections.Counter[str] = collections.Counter()
        self._reaper: asyncio.Task[None] | None = None
        self._endings: set[asyncio.Task[None]] = set()

    # --- lookups: what the caller may not see is answered as unknown

    def session(self, session_id: str, caller: Principal) -> _Session:
        session = self.sessions.get(session_id)
        if session is None or not caller.sees(session.owner):
            raise HTTPException(404, f"no session {session_id!r}: unknown, or it ended")
        return session

    def model(self, model_id: str, caller: Principal) -> _Model:
        model = self.models.get(model_id)
        if model is None or not caller.sees(model.owner):
            raise HTTPException(404, f"no model {model_id!r}: unknown, or it was unloaded")
        return model

    def created_model(self, model_id: str, caller: Principal) -> tuple[_Model, TinkerModelInfo]:
        model = self.model(model_id, caller)
        if model.info is None:
            raise HTTPException(404, f"no model {model_id!r}: it was not created")
        return model, model.info

    def sampler(self, sampler_id: str, caller: Principal) -> _Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or not caller.sees(sampler.owner):
            raise HTTPException(404, f"no sampling session {sampler_id!r}: unknown, or its session ended")
        return sampler

    def checkpoint(self, path: str, caller: Principal) -> tuple[_Model, _Checkpoint]:
        model_id, name = _checkpoint_path(path, "sampler_weights")
        model = self.model(model_id, caller)
        checkpoint = model.checkpoints.get(name)
        if checkpoint is None:
            raise HTTPException(404, f"no sampler weights at {path!r}")
        return model, checkpoint

    # --- per-key limit: a run key's sampling and model creation unfinished at once

    def admit(self, caller: Principal) -> None:
        limit = caller.max_concurrent_requests
        if caller.name is None or limit is None:
            return
        if self.in_flight[caller.name] >= limit:
            raise HTTPException(
                429, f"too many requests in flight for the key {caller.name!r}: at most {limit}"
            )
        self.in_flight[caller.name] += 1

    async def released(self, caller: Principal, work: Awaitable[T]) -> T:
        """`work`, counted against the caller's limit (admitted) until it ends."""
        try:
            return await work
        finally:
            if caller.name is not None and caller.max_concurrent_requests is not None:
                self.in_flight[caller.name] -= 1

    # --- sessions

    def create_session(self, caller: Principal) -> str:
        session_id = secrets.token_hex(8)
        self.sessions[session_id] = _Session(session_id, caller.name, time.monotonic())
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap())
        return session_id

    def heartbeat(self, session_id: str, caller: Principal) -> None:
        session = self.sessions.get(session_id)
        if session is None or not caller.sees(session.owner):
            # the SDK's heartbeat loop stops on 410 (tinker/lib/internal_client_holder.py)
            raise HTTPException(410, f"session {session_id!r} has ended")
        session.last_heartbeat = time.monotonic()

    def finish(self, session_id: str, caller: Principal) -> None:
        """Ends the session, its models unloaded in the background; an unknown or ended one is left as is
        (the SDK raises if its close() fails, and a reaped session is already finished)."""
        session = self.sessions.get(session_id)
        if session is not None and caller.sees(session.owner):
            task = asyncio.create_task(self.end_session(session, f"session {session_id} was finished"))
            self._endings.add(task)
            task.add_done_callback(self._endings.discard)

    async def end_session(self, session: _Session, reason: str) -> None:
        self.sessions.pop(session.session_id, None)
        for sampler_id in session.sampler_ids:
            self.samplers.pop(sampler_id, None)
        for model_id in session.model_ids:
            model = self.models.get(model_id)
            try:
                if model is not None:
                    await self.end_model(model, reason)
            except Exception:
                logger.exception("unloading the Tinker model %s failed", model_id)

    async def end_model(self, model: _Model, reason: str) -> None:
        """Fails its waiting requests, lets the running one finish, then unloads it."""
        if model.ended:
            return
        model.ended = True
        self.models.pop(model.model_id, None)
        await model.lane.close(f"model {model.model_id} was unloaded: {reason}")
        if model.info is not None:
            await self.service.unload(model.run)

    async def _reap(self) -> None:
        while self.sessions:  # create_session starts it again
            await asyncio.sleep(min(self.session_ttl_s / 2, 10.0))
            deadline = time.monotonic() - self.session_ttl_s
            for session in [s for s in self.sessions.values() if s.last_heartbeat < deadline]:
                logger.info(
                    "Tinker session %s had no heartbeat for %g s: ending it",
                    session.session_id,
                    self.session_ttl_s,
                )
                await self.end_session(session, f"its session had no heartbeat for {self.session_ttl_s:g} s")

    # --- models

    def create_model(
        self,
        body: bodies.CreateModel,
        caller: Principal,
        loaded: Callable[[_Model], Awaitable[FutureResult]] | None = None,
    ) -> sdk.UntypedAPIFuture:
        """The model's future: made, then (create_training_client_from_state) `loaded(model)`'s answer."""
        session = self.session(body.session_id, caller)
        model_id = f"{session.session_id}:train:{body.model_seq_id}"
        model = self.models.get(model_id)
        if model is None:  # else the same request sent again: its future
            self.admit(caller)
            lora = body.lora_config or bodies.LoraConfig()
            model = self.models[model_id] = _Model(
                model_id=model_id,
                session_id=session.session_id,
                owner=session.owner,
                base_model=body.base_model,
                lora_rank=lora.rank,
                user_metadata={key: str(value) for key, value in (body.user_metadata or {}).items()},
            )
            session.model_ids.append(model_id)

            async def work() -> FutureResult:
                made = await self._make_model(model, lora.seed, body.optimizer_config.type)
                return made if loaded is None else await loaded(model)

            model.create_request_id = self.futures.submit(model.owner, self.released(caller, work()))
        return sdk.UntypedAPIFuture(request_id=model.create_request_id, model_id=model_id)

    async def _make_model(self, model: _Model, seed: int | None, optimizer: str) -> sdk.CreateModelResponse:
        if model.base_model not in self.served_base_models:
            served = ", ".join(self.served_base_models)
            raise TinkerUserError(f"base model {model.base_model!r} is not served here: use one of {served}")
        if optimizer != "adamw":
            raise TinkerUserError(
                f"optimizer {optimizer!r} is not supported: art-ray trains with Adam (adamw)"
            )
        try:
            spec = TinkerModelSpec(
                run=model.run,
                base_model=model.base_model,
                lora_rank=model.lora_rank,
                seed=seed,
                owner=model.owner,
            )
        except pydantic.ValidationError as error:
            raise TinkerUserError(f"lora_config: {_invalid(error)}") from None
        info = await self.service.create_model(spec)
        if model.ended:  # its session ended while the service made it
            await self.service.unload(model.run)
            raise TinkerUserError(f"model {model.model_id} was unloaded: its session ended")
        model.info = info
        return sdk.CreateModelResponse(model_id=model.model_id)

    def get_info(self, model_id: str, caller: Principal) -> sdk.GetInfoResponse:
        model, info = self.created_model(model_id, caller)
        return sdk.GetInfoResponse(
            type="get_info",
            model_id=model.model_id,
            model_data=sdk.ModelData(model_name=info.base_model, tokenizer_id=info.tokenizer_id),
            is_lora=True,
            lora_rank=info.lora_rank,
            model_name=info.base_model,
        )

    def unload_model(self, model_id: str, caller: Principal) -> sdk.UntypedAPIFuture:
        model = self.model(model_id, caller)
        request_id = self.futures.submit(model.owner, self._unload(model))
        return sdk.UntypedAPIFuture(request_id=request_id, model_id=model.model_id)

    async def _unload(self, model: _Model) -> sdk.UnloadModelResponse:
        await self.end_model(model, "unload_model was called")
        return sdk.UnloadModelResponse(model_id=model.model_id, type="unload_model")

    # --- a model's requests, in its seq_id order

    def in_turn(
        self, model: _Model, seq_id: int, work: Callable[[], Awaitable[FutureResult]]
    ) -> sdk.UntypedAPIFuture:
        """The future of the model's request `seq_id`: `work()` once every earlier one ran (the one it got
        first if the SDK sends it again)."""
        request_id = model.lane.request_ids.get(seq_id)
        if request_id is None:
            turn = model.lane.run(seq_id, partial(self._on_model, model, work))
            request_id = model.lane.request_ids[seq_id] = self.futures.submit(model.owner, turn)
        return sdk.UntypedAPIFuture(request_id=request_id, model_id=model.model_id)

    async def _on_model(self, model: _Model, work: Callable[[], Awaitable[FutureResult]]) -> FutureResult:
        if model.info is None:
            raise TinkerUserError(f"model {model.model_id} was not created")
        model.last_request_time = _now()
        return await work()

    async def forward_backward(self, model: _Model, call: ForwardBackwardCall) -> bytes:
        return encode_forward_backward_output(await self.service.forward_backward(model.run, call))

    async def optim_step(self, model: _Model, body: bodies.OptimStep) -> sdk.OptimStepResponse:
        if body.adam_params is None:
            kind = (body.optimizer_params or {}).get("type", "none")
            raise TinkerUserError(
                f"optimizer params of type {kind!r}: art-ray's optimizer is Adam, send AdamParams"
            )
        try:
            step = AdamStep.model_validate(body.adam_params)
        except pydantic.ValidationError as error:
            raise TinkerUserError(f"adam_params: {_invalid(error)}") from None
        return sdk.OptimStepResponse(metrics=await self.service.optim_step(model.run, step))

    async def save_for_sampler(
        self, model: _Model, body: bodies.SaveWeightsForSampler
    ) -> sdk.SaveWeightsForSamplerResponseInternal:
        """Named: a checkpoint at tinker://<model_id>/sampler_weights/<name>. Unnamed (what
        save_weights_and_get_sampling_client sends): a sampling session on this snapshot."""
        name = _checkpoint_name(body.path) if body.path is not None else None
        weights = await self.service.save_for_sampler(model.run)
        if name is not None:
            model.checkpoints[name] = _Checkpoint(name, weights.served_name, _now())
            path = sampler_weights_path(model.model_id, name)
            return sdk.SaveWeightsForSamplerResponseInternal(path=path, type="save_weights_for_sampler")
        session = self.sessions.get(model.session_id)  # it may have ended while the weights were saved
        if body.sampling_session_seq_id is None or session is None:
            raise TinkerUserError("an unnamed save needs a sampling_session_seq_id, in a live session")
        sampler_id = self.add_sampler(
            session, body.sampling_session_seq_id, model.base_model, weights.served_name, None
        )
        return sdk.SaveWeightsForSamplerResponseInternal(
            sampling_session_id=sampler_id, type="save_weights_for_sampler"
        )

    # --- training state (save_state / load_state / create_training_client_from_state)

    async def save_state(self, model: _Model, body: bodies.SaveWeights) -> sdk.SaveWeightsResponse:
        name = _checkpoint_name(body.path)
        await self.service.save_state(model.run, name)
        model.states[name] = _Checkpoint(name, "", _now())
        return sdk.SaveWeightsResponse(path=weights_path(model.model_id, name), type="save_weights")

    async def saved_state(self, path: str, caller: Principal) -> SavedState:
        """What `path` (tinker://<model_id>/weights/<name>) holds, if the caller may load it: also after
        its model ended, for the key that made it."""
        model_id, name = _checkpoint_path(path, "weights")
        state = await self.service.saved_state(run_name(model_id), name)
        if state is None or not caller.sees(state.owner):
            raise HTTPException(404, f"no training state at {path!r}")
        return state

    async def load_state(
        self, model: _Model, state: SavedState, body: bodies.LoadWeights
    ) -> sdk.LoadWeightsResponse:
        await self.service.load_state(model.run, state, body.optimizer)
        return sdk.LoadWeightsResponse(path=body.path, model_id=model.model_id, type="load_weights")

    def create_from_state(
        self, body: bodies.LoadWeights, state: SavedState, caller: Principal
    ) -> sdk.UntypedAPIFuture:
        """A new model (the session's `model_seq_id`) of the state's shape, with the state loaded."""
        if body.session_id is None or body.model_seq_id is None:
            raise HTTPException(422, "load_weights needs model_id and seq_id, or session_id and model_seq_id")
        if body.base_model not in (None, state.base_model):
            raise HTTPException(
                422, f"the state at {body.path!r} is of {state.base_model}, not {body.base_model}"
            )
        create = bodies.CreateModel(
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
            base_model=state.base_model,
            lora_config=bodies.LoraConfig(rank=state.lora_rank),
            user_metadata=body.user_metadata,
            optimizer_config=body.optimizer_config or bodies.OptimizerConfig(),
        )
        return self.create_model(create, caller, loaded=partial(self.load_state, state=state, body=body))

    # --- sampling

    def add_sampler(
        self, session: _Session, seq_id: int, base_model: str, served_name: str, model_path: str | None
    ) -> str:
        sampler_id = f"{session.session_id}:sample:{seq_id}"
        if sampler_id not in self.samplers:  # else the same request sent again
            self.samplers[sampler_id] = _Sampler(
                sampler_id, session.owner, base_model, served_name, model_path
            )
            session.sampler_ids.append(sampler_id)
        return sampler_id

    def create_sampling_session(self, body: bodies.CreateSamplingSession, caller: Principal) -> str:
        session = self.session(body.session_id, caller)
        if body.model_path is not None:
            model, checkpoint = self.checkpoint(body.model_path, caller)
            base_model, served_name = model.base_model, checkpoint.served_name
        elif body.base_model is not None:
            if body.base_model not in self.served_base_models:
                served = ", ".join(self.served_base_models)
                raise HTTPException(
                    404, f"base model {body.base_model!r} is not served here: use one of {served}"
                )
            base_model = served_name = body.base_model
        else:
            raise HTTPException(422, "create_sampling_session needs a base_model or a model_path")
        return self.add_sampler(
            session, body.sampling_session_seq_id, base_model, served_name, body.model_path
        )

    def sample(self, body: bodies.Sample, caller: Principal) -> sdk.UntypedAPIFuture:
        if body.sampling_session_id is None:
            raise HTTPException(422, "asample needs a sampling_session_id: sample through a SamplingClient")
        sampler = self.sampler(body.sampling_session_id, caller)
        self.admit(caller)
        request_id = self.futures.submit(sampler.owner, self.released(caller, self._sample(sampler, body)))
        # one id per sequence, which the SDK stamps on the sequences it returns
        sequence_ids = [f"{request_id}:{index}" for index in range(body.num_samples)]
        return sdk.UntypedAPIFuture(request_id=request_id, sample_sequence_ids=sequence_ids)

    async def _sample(self, sampler: _Sampler, body: bodies.Sample) -> bytes:
        _refuse_unserved_sampling(body)
        params = body.sampling_params
        try:
            call = SampleCall(
                model=sampler.served_name,
                prompt=_prompt_tokens(body.prompt),
                num_samples=body.num_samples,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                seed=params.seed,
                stop=[params.stop] if isinstance(params.stop, str) else params.stop,
                prompt_logprobs=bool(body.prompt_logprobs),
            )
        except pydantic.ValidationError as error:
            raise TinkerUserError(f"sampling_params: {_invalid(error)}") from None
        last_n = body.prompt_logprobs_last_n
        if last_n is not None and not (call.prompt_logprobs and 1 <= last_n < len(call.prompt)):
            raise TinkerUserError("prompt_logprobs_last_n needs prompt_logprobs and 1 <= n < len(prompt)")
        result = await self.service.sample(call)
        if len(result.sequences) != call.num_samples:
            raise RuntimeError(
                f"{len(result.sequences)} sequences were sampled for {call.num_samples} samples"
            )
        if last_n is not None and result.prompt_logprobs is not None:
            scored = result.prompt_logprobs
            unscored: list[float | None] = [None] * (len(scored) - last_n)
            result = result.model_copy(update={"prompt_logprobs": unscored + scored[-last_n:]})
        return encode_sample_response(result)

    # --- futures

    async def retrieve(self, request_id: str, accept: str, caller: Principal) -> Response:
        try:
            outcome = await self.futures.retrieve(request_id, caller)
        except UnknownFutureError as error:
            raise HTTPException(404, str(error)) from None
        if outcome is None:
            return _json(TryAgainResponse(request_id=request_id, queue_state="active"))
        if isinstance(outcome, FutureFailure):
            category = sdk.RequestErrorCategory(outcome.category)
            return _json(sdk.RequestFailedResponse(error=outcome.message, category=category))
        if isinstance(outcome, bytes):
            if PROTOBUF not in accept:
                raise HTTPException(406, f"this result is protobuf only: send 'Accept: {PROTOBUF}'")
            return Response(outcome, media_type=PROTOBUF)
        return _json(outcome)

    def refused(self, owner: str | None, message: str) -> sdk.UntypedAPIFuture:
        """A future that fails with `message` (category user)."""
        return sdk.UntypedAPIFuture(request_id=self.futures.submit(owner, _refuse(message)))

    # --- the RestClient's views

    def training_runs(self, caller: Principal) -> list[sdk.TrainingRun]:
        return [
            self.training_run(model)
            for model in self.models.values()
            if model.info is not None and caller.sees(model.owner)
        ]

    def training_run(self, model: _Model) -> sdk.TrainingRun:
        latest = max(model.checkpoints.values(), key=lambda checkpoint: checkpoint.time, default=None)
        return sdk.TrainingRun(
            training_run_id=model.model_id,
            base_model=model.base_model,
            model_owner=model.owner or "admin",
            is_lora=True,
            lora_rank=model.lora_rank,
            last_request_time=model.last_request_time,
            last_sampler_checkpoint=None if latest is None else self.listed_checkpoint(model, latest),
            user_metadata=model.user_metadata or None,
        )

    def run_statuses(self) -> list[TinkerRunStatus]:
        """Every live training client's run, for `art-ray status` (the admin's view)."""
        return [
            TinkerRunStatus(
                model_id=model.model_id,
                run=model.run,
                owner=model.owner,
                base_model=model.base_model,
                lora_rank=model.lora_rank,
                checkpoints=[sampler_weights_path(model.model_id, name) for name in model.checkpoints]
                + [weights_path(model.model_id, name) for name in model.states],
            )
            for model in self.models.values()
            if model.info is not None
        ]

    def listed_checkpoint(self, model: _Model, checkpoint: _Checkpoint) -> sdk.Checkpoint:
        return sdk.Checkpoint(
            checkpoint_id=f"sampler_weights/{checkpoint.name}",
            checkpoint_type="sampler",
            time=checkpoint.time,
            tinker_path=sampler_weights_path(model.model_id, checkpoint.name),
        )

    def listed_state(self, model: _Model, state: _Checkpoint) -> sdk.Checkpoint:
        return sdk.Checkpoint(
            checkpoint_id=f"weights/{state.name}",
            checkpoint_type="training",
            time=state.time,
            tinker_path=weights_path(model.model_id, state.name),
        )


async def _refuse(message: str) -> FutureResult:
    raise TinkerUserError(message)


def _refuse_unserved_sampling(body: bodies.Sample) -> None:
    unserved = {
        "topk_prompt_logprobs": body.topk_prompt_logprobs > 0,
        "topk_sample_logprobs": body.topk_sample_logprobs > 0,
        "target_prompt_logprobs": body.target_prompt_logprobs is not None,
        "prompt_alt_tokens_k": body.prompt_alt_tokens_k > 0,
    }
    asked = [name for name, wanted in unserved.items() if wanted]
    if asked:
        raise TinkerUserError(f"{', '.join(asked)} is not served by art-ray's Tinker API")
    if body.record_stability_info:
        raise TinkerUserError(
            "record_stability_info (for the stable_reinforce loss) is not served: train with "
            "importance_sampling, ppo, cispo or dro"
        )


def _prompt_tokens(prompt: bodies.ModelInput) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.chunks:
        if chunk.type != "encoded_text":
            raise TinkerUserError(f"the prompt has a {chunk.type} chunk: only encoded_text (tokens) is taken")
        tokens.extend(chunk.tokens)
    if not tokens:
        raise TinkerUserError("the prompt has no tokens")
    return tokens


def tinker_app(
    service: TinkerService,
    authorize: Authorize,
    served_base_models: Collection[str],
    *,
    session_ttl_s: float = 300.0,
    futures: FutureTable | None = None,
) -> FastAPI:
    """The Tinker routes over `service`, relative (deploy at /api/v1). `authorize` judges the X-API-Key
    header (None when absent): it answers the caller, or raises UnknownKeyError (401). A session without
    a heartbeat for `session_ttl_s` ends and its models are unloaded."""
    front = _Front(service, served_base_models, session_ttl_s, futures or FutureTable())
    app = FastAPI(title="art-ray Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.authorize = authorize
    app.state.front = front  # its run_statuses, for the Serve deployment's `art-ray status` call

    @app.exception_handler(StarletteHTTPException)  # what FastAPI's own routing raises
    async def client_error(_: Request, error: StarletteHTTPException) -> Response:
        # FastAPI answers a body it cannot decode (not UTF-8) with a 400, which the SDK would retry
        status = 422 if error.status_code == 400 else error.status_code
        return JSONResponse({"detail": error.detail}, status_code=status, headers=error.headers)

    @app.post("/client/config")
    async def client_config(_: Caller) -> Response:
        return _json(CLIENT_CONFIG)

    @app.post("/client/dynamic_config")
    async def client_dynamic_config(_: Caller) -> Response:
        return _json(sdk.ClientDynamicConfigResponse())

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json(sdk.HealthResponse(status="ok"))

    @app.get("/get_server_capabilities")
    async def get_server_capabilities(_: Caller) -> Response:
        models = [
            sdk.SupportedModel(model_name=name, trainable=True, sampleable=True)
            for name in front.served_base_models
        ]
        return _json(sdk.GetServerCapabilitiesResponse(supported_models=models))

    @app.post("/telemetry")
    async def telemetry(_: Caller) -> Response:
        return _json(sdk.TelemetryResponse(status="accepted"))

    @app.post("/create_session")
    async def create_session(caller: Caller) -> Response:
        return _json(sdk.CreateSessionResponse(session_id=front.create_session(caller)))

    @app.post("/session_heartbeat")
    async def session_heartbeat(body: bodies.SessionRef, caller: Caller) -> Response:
        front.heartbeat(body.session_id, caller)
        return _json(sdk.SessionHeartbeatResponse())

    @app.post("/sessions/{session_id}/finish")
    async def finish_session(session_id: str, caller: Caller) -> Response:
        front.finish(session_id, caller)
        return JSONResponse({})

    @app.post("/create_model")
    async def create_model(body: bodies.CreateModel, caller: Caller) -> Response:
        return _json(front.create_model(body, caller))

    @app.post("/get_info")
    async def get_info(body: bodies.ModelRef, caller: Caller) -> Response:
        return _json(front.get_info(body.model_id, caller))

    @app.post("/unload_model")
    async def unload_model(body: bodies.ModelRef, caller: Caller) -> Response:
        return _json(front.unload_model(body.model_id, caller))

    @app.post("/forward_backward")
    async def forward_backward(request: Request, caller: Caller) -> Response:
        """forward() too (forward_only); the body is protobuf. A malformed one still takes its turn, so
        the model's later requests do not wait for it."""
        try:
            model_id, seq_id, call = decode_forward_backward(
                await request.body(), request.headers.get("content-encoding")
            )
        except MalformedForwardBackwardError as error:
            if error.model_id is None or error.seq_id is None:
                raise HTTPException(422, str(error)) from None
            model = front.model(error.model_id, caller)
            return _json(front.in_turn(model, error.seq_id, partial(_refuse, str(error))))
        model = front.model(model_id, caller)
        return _json(front.in_turn(model, seq_id, partial(front.forward_backward, model, call)))

    @app.post("/optim_step")
    async def optim_step(body: bodies.OptimStep, caller: Caller) -> Response:
        model = front.model(body.model_id, caller)
        return _json(front.in_turn(model, body.seq_id, partial(front.optim_step, model, body)))

    @app.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(body: bodies.SaveWeightsForSampler, caller: Caller) -> Response:
        model = front.model(body.model_id, caller)
        return _json(front.in_turn(model, body.seq_id, partial(front.save_for_sampler, model, body)))

    @app.post("/save_weights")
    async def save_weights(body: bodies.SaveWeights, caller: Caller) -> Response:
        model = front.model(body.model_id, caller)
        return _json(front.in_turn(model, body.seq_id, partial(front.save_state, model, body)))

    @app.post("/load_weights")
    async def load_weights(body: bodies.LoadWeights, caller: Caller) -> Response:
        state = await front.saved_state(body.path, caller)
        if body.model_id is None or body.seq_id is None:  # create_training_client_from_state
            return _json(front.create_from_state(body, state, caller))
        model = front.model(body.model_id, caller)
        return _json(front.in_turn(model, body.seq_id, partial(front.load_state, model, state, body)))

    @app.post("/save_weights_external")
    async def save_weights_external(body: bodies.ExternalWeights, caller: Caller) -> Response:
        """Refused as a failed future, in its model's turn, so the requests after it do not wait for a
        seq_id that never runs."""
        if body.model_id is None or body.seq_id is None:
            return _json(front.refused(caller.name, UNSERVED_EXTERNAL_WEIGHTS))
        model = front.model(body.model_id, caller)
        return _json(front.in_turn(model, body.seq_id, partial(_refuse, UNSERVED_EXTERNAL_WEIGHTS)))

    @app.post("/create_sampling_session")
    async def create_sampling_session(body: bodies.CreateSamplingSession, caller: Caller) -> Response:
        sampler_id = front.create_sampling_session(body, caller)
        return _json(sdk.CreateSamplingSessionResponse(sampling_session_id=sampler_id))

    @app.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, caller: Caller) -> Response:
        sampler = front.sampler(sampler_id, caller)
        return _json(
            sdk.GetSamplerResponse(
                sampler_id=sampler.sampler_id, base_model=sampler.base_model, model_path=sampler.model_path
            )
        )

    @app.post("/asample")
    async def asample(body: bodies.Sample, caller: Caller) -> Response:
        return _json(front.sample(body, caller))

    @app.post("/retrieve_future")
    async def retrieve_future(body: bodies.RetrieveFuture, request: Request, caller: Caller) -> Response:
        return await front.retrieve(body.request_id, request.headers.get("accept", ""), caller)

    @app.get("/training_runs")
    async def training_runs(caller: Caller, limit: int = 20, offset: int = 0) -> Response:
        runs = front.training_runs(caller)
        cursor = sdk.Cursor(offset=offset, limit=limit, total_count=len(runs))
        return _json(sdk.TrainingRunsResponse(training_runs=runs[offset : offset + limit], cursor=cursor))

    @app.get("/training_runs/{model_id}")
    async def training_run(model_id: str, caller: Caller) -> Response:
        model, _ = front.created_model(model_id, caller)
        return _json(front.training_run(model))

    @app.get("/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str, caller: Caller) -> Response:
        model, _ = front.created_model(model_id, caller)
        listed = [front.listed_checkpoint(model, checkpoint) for checkpoint in model.checkpoints.values()]
        listed += [front.listed_state(model, state) for state in model.states.values()]
        return _json(sdk.CheckpointsListResponse(checkpoints=listed))

    document: dict | None = None

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(_: Caller) -> Response:
        nonlocal document
        if document is None:
            document = tinker_openapi(app.openapi(), sorted(front.served_base_models))
        return JSONResponse(document)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def unserved(path: str, request: Request) -> Response:
        # a 404 the SDK raises at once, naming what is missing (a 405 or 501 it would not say as clearly)
        raise HTTPException(404, f"art-ray's Tinker API does not serve {request.method} /{path}")

    return app
