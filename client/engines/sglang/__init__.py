"""tracestore's SGLang plugin (``sglang.srt.plugins`` entry point ``tracestore``).

Enabled by one setting, ``TRACESTORE_RECORD`` (:mod:`tracestore.client.engines.setting`).
:func:`register` runs in every SGLang process that calls ``load_plugins()`` (the engine's main
process, each scheduler process, the detokenizer); it does nothing without the setting, refuses any
SGLang release but :data:`VALIDATED_VERSIONS` (a ``ConfigError`` naming both versions, which
SGLang's loader logs: the engine then runs without recording), and registers its hooks with
SGLang's ``HookRegistry`` once per process (:mod:`.hooks`).
"""

from __future__ import annotations

from tracestore.client.engines.setting import PluginRegistration, RecordSetting

VALIDATED_VERSIONS: tuple[str, ...] = ("0.5.23",)
_REGISTRATION = PluginRegistration("sglang", VALIDATED_VERSIONS)


def register() -> None:
    """The entry point: check the setting and the version, then register the hooks (idempotent)."""

    def version() -> str:
        import sglang

        return str(sglang.__version__)

    def install(setting: RecordSetting) -> None:
        from . import hooks

        hooks.register_hooks(setting)

    _REGISTRATION.register(version, install)
