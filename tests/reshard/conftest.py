from __future__ import annotations

from typing import Any

import pytest
import torch

from .gptstate import reference


@pytest.fixture(scope="session")
def ref(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The single-process reference: the GPT trained two steps, its logical state (flat names), the
    optimizer step and the loss of the next step; also saved to ``path`` for the worker processes."""
    out = reference(steps=2)
    path = tmp_path_factory.mktemp("reshard-ref") / "ref.pt"
    torch.save(out, path)
    out["path"] = str(path)
    return out
