"""tracestore's vLLM plugin (``vllm.general_plugins`` entry point ``tracestore``).

Enabled by one setting, ``TRACESTORE_RECORD`` (:mod:`tracestore.client.engines.setting`), plus the
KV connector that carries rows from the scheduler to the workers::

    LLM(model, kv_transfer_config={"kv_connector": "TraceStoreConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "tracestore.client.engines.vllm.connector"})

:func:`register` runs in every vLLM process; it does nothing without the setting, refuses any vLLM
release but :data:`VALIDATED_VERSIONS` (a ``ConfigError`` naming both versions: vLLM then does not
start), and installs the capture hooks once per process (:mod:`.hooks`; calling it again changes
nothing).
"""

from __future__ import annotations

from tracestore.client.engines.setting import PluginRegistration, RecordSetting

VALIDATED_VERSIONS: tuple[str, ...] = ("0.32.0",)
_REGISTRATION = PluginRegistration("vllm", VALIDATED_VERSIONS)


def register() -> None:
    """The entry point: check the setting and the version, then install the hooks (idempotent)."""

    def version() -> str:
        import vllm

        return str(vllm.__version__)

    def install(setting: RecordSetting) -> None:
        from . import hooks

        hooks.install(setting)

    _REGISTRATION.register(version, install)
