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


class QuotaExceededError(ArtRayError, ValueError):
    """A call is over its key's limit (art_ray/access.py: tokens per train call); nothing was trained."""
