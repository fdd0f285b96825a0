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

import threading

VALIDATED_VERSIONS: tuple[str, ...] = ("0.32.0",)
_lock = threading.Lock()
_installed = False


def register() -> None:
    """The entry point: check the setting and the version, then install the hooks (idempotent)."""
    global _installed
    from tracestore.client.engines.setting import check_engine_version, setting_from_env

    setting = setting_from_env()
    if setting is None:
        return
    import vllm

    check_engine_version("vllm", vllm.__version__, VALIDATED_VERSIONS)
    with _lock:
        if _installed:
            return
        from . import hooks

        hooks.install(setting)
        _installed = True
