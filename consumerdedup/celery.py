"""Idempotent Celery tasks: ``from consumerdedup.celery import IdempotentTask`` (the
``celery`` extra); the code is consumerdedup.integrations.celery."""

try:
    from .integrations.celery import IdempotentTask
except ModuleNotFoundError as missing:  # pragma: no cover - depends on the install
    if missing.name not in ("celery", "kombu"):
        raise
    raise ModuleNotFoundError(
        "consumerdedup.celery needs Celery: pip install 'consumerdedup[celery]'",
        name=missing.name,
    ) from missing

__all__ = ["IdempotentTask"]
