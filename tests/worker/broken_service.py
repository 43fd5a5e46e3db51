"""A service module whose import fails, as a typo in a real one would."""

from __future__ import annotations

raise RuntimeError("the service's module failed at import (a test of `consumerdedup run`)")
