"""A FastStream middleware that runs each message once: ``from consumerdedup.faststream
import DedupMiddleware`` (the ``faststream`` extra); the code is
consumerdedup.integrations.faststream."""

try:
    from .integrations.faststream import SESSION, DedupMiddleware, refuse_policy
    from .integrations.faststream_ids import NATS_ID_HEADER, KeyFunction
except ModuleNotFoundError as missing:  # pragma: no cover - depends on the install
    if missing.name != "faststream" and not (missing.name or "").startswith("faststream."):
        raise
    raise ModuleNotFoundError(
        "consumerdedup.faststream needs FastStream: pip install 'consumerdedup[faststream]'",
        name=missing.name,
    ) from missing

__all__ = ["NATS_ID_HEADER", "SESSION", "DedupMiddleware", "KeyFunction", "refuse_policy"]
