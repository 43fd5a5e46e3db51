"""consumerdedup.admin: the operator's web pages (the ``admin`` extra).

``admin_app(engine, authorize=...)`` is an ASGI application to mount in your own
(``app.mount("/admin", admin_app(engine, authorize=my_auth, actions=True))``);
``consumerdedup admin --db URL`` serves it on 127.0.0.1. See docs/admin.md.
"""

from __future__ import annotations

try:
    from .app import admin_app
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"consumerdedup.admin needs the admin extra: pip install 'consumerdedup[admin]' ({error})"
    ) from error
from .audit import AuditEntry
from .audit_table import AuditTable
from .replay import DeadLetterReplay, KafkaReplay, RabbitMQReplay
from .security import Grant, Role

__all__ = [
    "AuditEntry",
    "AuditTable",
    "DeadLetterReplay",
    "Grant",
    "KafkaReplay",
    "RabbitMQReplay",
    "Role",
    "admin_app",
]
