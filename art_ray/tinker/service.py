"""`RayTinkerService`: the Tinker API's work on a RayBackend. Each training client is an art-ray run (its
own adapter, optimizer state and step on the base model's shared trainer, served on the OpenAI endpoint
as `run` and `run@step`); samples come from the same engines through the OpenAI endpoint."""

from __future__ import annotations

import asyncio
import math

import openai

from art_ray import storage
from art_ray.adapters.spec import LoRASpec, versioned_name
from art_ray.backend import RayBackend
from art_ray.errors import BackendError
from art_ray.model import TrainableModel
from art_ray.model_config import ModelConfig
from art_ray.models import resolve_base_model
from art_ray.serving.vllm_app import BASE_MODEL_NAME
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
from art_ray.trainer.config import model_dir

PROJECT = "tinker"
# written into a saved state's folder once the state is complete: what it is and who may load it
STATE_INFO = "tinker_state.json"


class RayTinkerService:
    """`base_models`: the names clients may ask for (the first is what the backend's engines serve);
    `run_config`: the ModelConfig every run starts from (its LoRA rank is the client's)."""

    def __init__(self, backend: RayBackend, base_models: list[str], run_config: ModelConfig) -> None:
        self.backend = backend
        self.base_models = base_models
        self.run_config = run_config
        self.models: dict[str, TrainableModel] = {}
        self._register_lock = asyncio.Lock()
        self._client: openai.AsyncOpenAI | None = None

    def _model(self, run: str) -> TrainableModel:
        model = self.models.get(run)
        if model is None or not self.backend.is_registered(run):
            raise TinkerUserError(f"no training run {run!r}: it ended or was never made")
        return model

    async def create_model(self, spec: TinkerModelSpec) -> TinkerModelInfo:
        if spec.base_model not in self.base_models:
            raise TinkerUserError(
                f"unknown base model {spec.base_model!r}: this server trains {', '.join(self.base_models)}"
            )
        lora = LoRASpec.model_validate({**self.run_config.lora.model_dump(), "r": spec.lora_rank})
        updates: dict[str, object] = {"lora": lora, "owner": spec.owner}
        if spec.seed is not None:
            updates["seed"] = spec.seed
        model = TrainableModel(
            name=spec.run,
            project=PROJECT,
            base_model=spec.base_model,
            config=self.run_config.model_copy(update=updates),
        )
        async with self._register_lock:
            if spec.run in self.models:
                raise TinkerUserError(f"a training run {spec.run!r} exists")
            try:
                await model.register(self.backend)
            except BackendError as error:  # a rank above what the engines load, another base model
                raise TinkerUserError(str(error)) from None
            self.models[spec.run] = model
        return TinkerModelInfo(
            run=spec.run,
            base_model=spec.base_model,
            lora_rank=spec.lora_rank,
            tokenizer_id=resolve_base_model(spec.base_model),
        )

    async def forward_backward(self, run: str, call: ForwardBackwardCall) -> ForwardBackwardResult:
        return await self.backend.forward_backward(self._model(run), call)

    async def optim_step(self, run: str, step: AdamStep) -> dict[str, float]:
        return await self.backend.optim_step(self._model(run), step)

    async def save_for_sampler(self, run: str) -> SamplerWeights:
        step = await self.backend.save_for_sampler(self._model(run))
        return SamplerWeights(run=run, step=step, served_name=versioned_name(run, step))

    def _state_folder(self, run: str, name: str) -> str:
        return f"{model_dir(self.backend.storage, PROJECT, run)}/states/{name}"

    async def save_state(self, run: str, name: str) -> SavedState:
        model = self._model(run)
        folder = self._state_folder(run, name)
        await self.backend.save_state(model, folder)
        state = SavedState(
            run=run,
            name=name,
            step=await self.backend.get_step(model),
            base_model=model.base_model,
            lora_rank=model.config.lora.r,
            owner=model.config.owner,
        )
        storage.write_text(f"{folder}/{STATE_INFO}", state.model_dump_json())  # last: the state is whole
        return state

    async def saved_state(self, run: str, name: str) -> SavedState | None:
        info = f"{self._state_folder(run, name)}/{STATE_INFO}"
        if not storage.exists(info):
            return None
        return SavedState.model_validate_json(storage.read_text(info))

    async def load_state(self, run: str, state: SavedState, optimizer: bool) -> int:
        model = self._model(run)
        if (state.base_model, state.lora_rank) != (model.base_model, model.config.lora.r):
            raise TinkerUserError(
                f"the state {state.name!r} is of a rank-{state.lora_rank} LoRA on {state.base_model}; this "
                f"model is a rank-{model.config.lora.r} LoRA on {model.base_model}"
            )
        return await self.backend.load_state(model, self._state_folder(state.run, state.name), optimizer)

    async def sample(self, call: SampleCall) -> SampleResult:
        """Through the OpenAI endpoint's completions route, with token ids in and out."""
        model = BASE_MODEL_NAME if call.model in self.base_models else call.model
        greedy = call.temperature == 0
        extra: dict[str, object] = {"return_token_ids": True, "top_k": call.top_k}
        if call.prompt_logprobs:
            extra["prompt_logprobs"] = 0
        if call.stop == []:  # Tinker's "no stop at all, not even EOS": until max_tokens
            extra["ignore_eos"] = True
        elif call.stop and isinstance(call.stop[0], int):
            extra["stop_token_ids"] = call.stop
        try:
            completion = await self._endpoint().completions.create(
                model=model,
                prompt=call.prompt,
                # greedy sampling is one answer; vLLM refuses n > 1 for it
                n=1 if greedy else call.num_samples,
                max_tokens=call.max_tokens,
                temperature=call.temperature,
                top_p=call.top_p,
                seed=call.seed,
                stop=[s for s in call.stop if isinstance(s, str)] if call.stop else None,
                logprobs=0,  # the sampled token's own
                extra_body=extra,
            )
        except openai.BadRequestError as error:
            raise TinkerUserError(f"the engine refused the sample request: {error.message}") from None
        except openai.NotFoundError:
            # the replicas hold each run's last keep_versions snapshots (ModelConfig.keep_versions)
            raise TinkerUserError(
                f"{model} is no longer served: the engines keep a run's last "
                f"{self.run_config.keep_versions} sampler snapshots; save_weights_for_sampler again"
            ) from None
        sequences = [
            SampledTokens(
                tokens=list(choice.token_ids),  # type: ignore[attr-defined]  # vLLM's return_token_ids
                logprobs=[float(lp) for lp in choice.logprobs.token_logprobs],
                stop_reason="length" if choice.finish_reason == "length" else "stop",
            )
            for choice in completion.choices
        ]
        if greedy:
            sequences *= call.num_samples
        prompt_logprobs = None
        if call.prompt_logprobs:
            scored = getattr(completion.choices[0], "prompt_logprobs", None) or []
            prompt_logprobs = [
                _prompt_logprob(entry, token) for entry, token in zip(scored, call.prompt, strict=True)
            ]
        return SampleResult(sequences=sequences, prompt_logprobs=prompt_logprobs)

    def _endpoint(self) -> openai.AsyncOpenAI:
        """The OpenAI endpoint of the backend's engines, with its admin key (one client, kept)."""
        if self.backend.base_url is None:
            raise TinkerUserError("no engine serves yet: the first training client starts them")
        if self._client is None:
            self._client = openai.AsyncOpenAI(
                base_url=self.backend.base_url, api_key=self.backend.api_key or "unused", max_retries=0
            )
        return self._client

    async def unload(self, run: str) -> None:
        model = self.models.pop(run, None)
        if model is not None and self.backend.is_registered(run):
            await self.backend.delete_run(model)


def _prompt_logprob(entry: dict | None, token: int) -> float | None:
    """vLLM's prompt_logprobs entry for one position: {token id: {logprob, ...}}; None for the first."""
    if not entry:
        return None
    scored = entry.get(str(token)) or entry.get(token)  # type: ignore[call-overload]
    if scored is None:
        return math.nan
    return float(scored["logprob"] if isinstance(scored, dict) else scored.logprob)
