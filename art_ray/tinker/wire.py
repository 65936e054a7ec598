"""The SDK's protobuf bodies: forward_backward requests in, ForwardBackwardOutput and SampleResponse out.

Read and written with the SDK's own message classes (tinker/proto/tinker_public_pb2.py), so the bytes are
those its proto/request_conv.py writes and its proto/response_conv.py reads.
"""

from __future__ import annotations

import io
import math

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from art_ray.tinker.types import (
    LOSS_NAMES,
    ForwardBackwardCall,
    ForwardBackwardResult,
    LossDatum,
    SampleResult,
    TinkerUserError,
)

# Far above the SDK's 5 MB chunks, and a bound on what a small zstd body may inflate to.
MAX_BODY_BYTES = 256 * 1024 * 1024

INPUT_NAMES: tuple[str, ...] = ("target_tokens", "weights", "logprobs", "advantages")
# Every loss reads its targets; the policy-gradient losses also the sampler's logprobs and the advantages.
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    name: ("target_tokens",) if name == "cross_entropy" else ("target_tokens", "logprobs", "advantages")
    for name in LOSS_NAMES
}

_INTEGER_DTYPES = {pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}
_FLOAT_DTYPES = {pb.DTYPE_FLOAT32: "<f4", **_INTEGER_DTYPES}


class MalformedForwardBackwardError(TinkerUserError):
    """A forward_backward body that cannot be trained on. `model_id` and `seq_id` name the training request
    (None: the body did not parse that far), so its future can still fail in that request's turn."""

    def __init__(self, message: str, model_id: str | None = None, seq_id: int | None = None) -> None:
        super().__init__(message)
        self.model_id = model_id
        self.seq_id = seq_id


def decode_forward_backward(
    body: bytes, content_encoding: str | None
) -> tuple[str, int, ForwardBackwardCall]:
    """(model_id, seq_id, call) of a forward_backward (or, with forward_only, forward) body. Raises
    MalformedForwardBackwardError, a TinkerUserError, for what the client must change."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(_inflate(body, content_encoding))
    except DecodeError as error:
        raise MalformedForwardBackwardError(f"the forward_backward body is not protobuf: {error}") from None
    try:
        call = ForwardBackwardCall(
            data=[_loss_datum(index, datum) for index, datum in enumerate(message.data)],
            loss_fn=_loss_name(message.loss_fn),
            loss_fn_config=_loss_fn_config(message),
            forward_only=message.forward_only,
        )
        _check_inputs(call)
    except TinkerUserError as error:
        raise MalformedForwardBackwardError(str(error), message.model_id, message.seq_id) from None
    return message.model_id, message.seq_id, call


def _inflate(body: bytes, content_encoding: str | None) -> bytes:
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding != "zstd":
        raise MalformedForwardBackwardError(
            f"unsupported Content-Encoding {content_encoding!r}: send zstd or none"
        )
    try:
        inflated = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)).read(MAX_BODY_BYTES + 1)
    except zstandard.ZstdError as error:
        raise MalformedForwardBackwardError(f"the zstd body does not decompress: {error}") from None
    if len(inflated) > MAX_BODY_BYTES:
        raise MalformedForwardBackwardError(
            f"the body inflates past {MAX_BODY_BYTES} bytes: send smaller chunks"
        )
    return inflated


def _loss_name(name: str) -> str:
    if name not in LOSS_NAMES:
        raise TinkerUserError(f"loss_fn {name!r} is not supported here: use one of {', '.join(LOSS_NAMES)}")
    return name


def _loss_fn_config(message: pb.ForwardBackwardRequest) -> dict[str, float]:
    # The SDK writes numbers to both maps and text to v2 only; v2 is the newer and wins.
    if not message.loss_fn_config_v2:
        return dict(message.loss_fn_config)
    config: dict[str, float] = {}
    for key, value in message.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise TinkerUserError(f"loss_fn_config[{key!r}] must be a number")
        config[key] = value.number
    return config


def _loss_datum(index: int, datum: pb.Datum) -> LossDatum:
    where = f"data[{index}]"
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise TinkerUserError(
                f"{where}.model_input has a {kind} chunk: only encoded_text (tokens) is taken"
            )
        tokens.extend(_array(chunk.encoded_text.tokens, "<i4", f"{where}.model_input").tolist())
    if not tokens:
        raise TinkerUserError(f"{where}.model_input has no tokens")
    unknown = sorted(set(datum.loss_fn_inputs) - set(INPUT_NAMES))
    if unknown:
        raise TinkerUserError(
            f"{where}.loss_fn_inputs has {', '.join(map(repr, unknown))}: the inputs taken are "
            f"{', '.join(INPUT_NAMES)}"
        )
    inputs = {
        name: _input_values(f"{where}.loss_fn_inputs[{name!r}]", tensor, len(tokens), name == "target_tokens")
        for name, tensor in datum.loss_fn_inputs.items()
    }
    return LossDatum(tokens=tokens, **inputs)


def _input_values(where: str, tensor: pb.Tensor, length: int, integer: bool) -> list[int] | list[float]:
    # The SDK sends CSR only for 2-D tensors (a crow pointer per row): one value per position is 1-D.
    if tensor.WhichOneof("encoding") == "sparse_csr" or len(tensor.shape) > 1:
        raise TinkerUserError(
            f"{where} has shape {list(tensor.shape)}: art-ray takes 1-D inputs, one value per position"
        )
    dtypes = _INTEGER_DTYPES if integer else _FLOAT_DTYPES
    if tensor.dtype not in dtypes:
        raise TinkerUserError(
            f"{where} has dtype {pb.DType.Name(tensor.dtype)}: expected {'int64' if integer else 'float32'}"
        )
    values = _array(tensor.dense, dtypes[tensor.dtype], where)
    if values.size != length:
        raise TinkerUserError(f"{where} has {values.size} values for {length} tokens: give one per position")
    if not integer and not np.isfinite(values).all():
        raise TinkerUserError(f"{where} holds NaN or infinite values")
    return values.tolist() if integer else values.astype(np.float64).tolist()


def _array(raw: bytes, dtype: str, where: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise TinkerUserError(f"{where} holds {len(raw)} bytes, not a whole number of {itemsize}-byte values")
    return np.frombuffer(raw, dtype=dtype)


def _check_inputs(call: ForwardBackwardCall) -> None:
    for index, datum in enumerate(call.data):
        missing = [name for name in REQUIRED_INPUTS[call.loss_fn] if getattr(datum, name) is None]
        if missing:
            raise TinkerUserError(f"data[{index}]: {call.loss_fn} needs loss_fn_inputs {', '.join(missing)}")
    if not call.data:
        raise TinkerUserError("forward_backward needs at least one datum")


def encode_forward_backward_output(result: ForwardBackwardResult) -> bytes:
    """The ForwardBackwardOutput protobuf: one ArrayRecord of per-datum `logprobs` and `elementwise_loss`."""
    if len(result.logprobs) != len(result.elementwise_loss):
        raise ValueError(
            f"{len(result.logprobs)} logprob rows and {len(result.elementwise_loss)} loss rows: one per datum"
        )
    record = pb.ArrayRecord(
        type_tag="ArrayRecord",
        num_datums=len(result.logprobs),
        fields={"logprobs": _batched(result.logprobs), "elementwise_loss": _batched(result.elementwise_loss)},
    )
    output = pb.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=result.metrics
    )
    return output.SerializeToString()


def _batched(rows: list[list[float]]) -> pb.BatchedTensor:
    """Rows of any lengths, back to back; `offsets` are the byte offsets of each row's start and the end."""
    arrays = [np.asarray(row, dtype="<f4") for row in rows]
    offsets = np.cumsum([0, *(array.nbytes for array in arrays)], dtype="<i8")
    return pb.BatchedTensor(
        data=b"".join(array.tobytes() for array in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32
    )


def encode_sample_response(result: SampleResult) -> bytes:
    """The SampleResponse protobuf; an unscored prompt position (None) travels as NaN."""
    response = pb.SampleResponse()
    for sequence in result.sequences:
        response.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if sequence.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype="<f4").tobytes(),
        )
    if result.prompt_logprobs is not None:
        scored = [math.nan if value is None else value for value in result.prompt_logprobs]
        response.prompt_logprobs = np.asarray(scored, dtype="<f4").tobytes()
    return response.SerializeToString()
