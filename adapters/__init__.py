"""Broker adapters: thin translations from deliveries to Message and back to ack/nack.

Installed as ``consumerdedup.adapters``; each broker lives in its own subpackage
and needs its extra (``pip install consumerdedup[kafka]`` or ``[rabbitmq]``).
"""
