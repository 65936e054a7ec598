"""Typed exceptions of the art-ray SDK; each says what went wrong and what to do about it."""


class ArtRayError(Exception):
    """Base class of art-ray's own errors."""


class MissingTokenDataError(ArtRayError, ValueError):
    """A choice lacks the sampled token ids or logprobs that training needs."""


class ModelPreparationError(ArtRayError, RuntimeError):
    """A local base model could not be built (a missing package, a failed check)."""


class BackendError(ArtRayError, RuntimeError):
    """A backend refused a call (a model not registered, or one its engines cannot serve)."""


class NothingToTrainError(ArtRayError, ValueError):
    """A train call's groups hold nothing a step could learn from; nothing was trained or advanced."""


class CaptureError(ArtRayError, ValueError):
    """A capture session's recorded turns cannot become a Trajectory (none recorded, or one malformed)."""


class FeedbackError(ArtRayError, ValueError):
    """The endpoint refused a feedback (`status`: 404 no such stored turn for this key, 400 malformed,
    401 bad key or token); nothing was stored."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class ReleaseError(ArtRayError, ValueError):
    """A release action that cannot be taken (the run has no release, no candidate, an unknown step);
    nothing changed."""


class QuotaExceededError(ArtRayError, ValueError):
    """A call is over its key's limit (art_ray/access.py: tokens per train call); nothing was trained."""


class PortInUseError(ArtRayError, RuntimeError):
    """A port asked for explicitly already has a listener that is not this cluster's Serve: Ray Serve's proxy
    binds with SO_REUSEPORT, so starting there would share the port and split requests between the two."""

    def __init__(self, host: str, port: int, holder: str, how_to_choose: str) -> None:
        super().__init__(
            f"port {port} on {host} is already in use by {holder}. Serve started there would fail, or, "
            "beside another Serve (its proxy binds with SO_REUSEPORT), share the port while the kernel "
            f"splits requests between the two. Choose another port with {how_to_choose}, or leave the port "
            "unset to have a free one taken."
        )
        self.host, self.port, self.holder = host, port, holder


class SandboxError(ArtRayError, RuntimeError):
    """The sandbox's own machinery failed (a slot died, a pipe broke, a lease expired): not the model's
    fault. A reward computed from it is not a score: drop the sample from training instead of scoring 0."""


class SandboxBusy(SandboxError):
    """Every slot is leased and the waiting line is full; try again later or make the pool larger."""


class LeaseExpired(SandboxError):
    """The lease outlived its time to live: its processes were killed and its slot is being replaced."""


class SandboxFileError(ArtRayError, ValueError):
    """A file operation the sandbox refused for the caller's (the model's) reason: no such file, a
    read-only path, a file over the size limit. The sandbox itself is fine."""
