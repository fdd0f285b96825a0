import json
from pathlib import Path

import pytest

# The public worked cases of the FP4/TRACE arithmetic (docs/numerics.md, "Public test vectors").
VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "public.json"


def load_vectors() -> dict:
    if not VECTORS.exists():  # pragma: no cover - tests/vectors/ is part of the repository
        pytest.skip(f"public vectors not found at {VECTORS}", allow_module_level=True)
    return json.loads(VECTORS.read_text())
