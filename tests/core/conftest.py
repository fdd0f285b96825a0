import json
from pathlib import Path

import pytest

# The normative worked cases live beside the design docs, one level above the checkout.
VECTORS = Path(__file__).resolve().parents[3] / "shared" / "vectors" / "public.json"


def load_vectors() -> dict:
    if not VECTORS.exists():  # pragma: no cover - the checkout always sits next to shared/
        pytest.skip(f"public vectors not found at {VECTORS}", allow_module_level=True)
    return json.loads(VECTORS.read_text())
