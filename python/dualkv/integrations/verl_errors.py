"""The veRL engine's error type: a setting DualKV cannot run packed raises it, naming it."""

from __future__ import annotations

__all__ = ["SWITCH", "DualKVVerlError", "unsupported"]

SWITCH = "actor_rollout_ref.model.override_config.attn_implementation=dualkv"


class DualKVVerlError(ValueError):
    """A veRL setting the DualKV engine cannot run packed (the message names it)."""


def unsupported(what: str) -> DualKVVerlError:
    """The error for a veRL feature the DualKV engine does not run yet: it names ``what`` and the
    switch, and says to turn the feature off or run without DualKV."""
    return DualKVVerlError(
        f"DualKV engine ({SWITCH}): {what} is not supported yet; turn it off or run without DualKV"
    )
