"""Integrations for consumers the library does not run: ``process_once`` for hand-written
loops (no extra), Celery (the ``celery`` extra). Each is a thin layer over the processor
every runner uses (consumerdedup.dedup.processing): one decision logic."""
