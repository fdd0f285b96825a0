"""transformers API names that changed across the versions the tests run with."""

from __future__ import annotations

from typing import Any


def checkpointing_on(model: Any, kwargs: dict[str, Any]) -> None:
    """Activation checkpointing on (transformers >= 5.24 renames ``gradient_checkpointing_enable``,
    which warns there and goes in v6)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_off(model: Any) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
