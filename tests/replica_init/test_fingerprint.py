from __future__ import annotations

import pytest
import torch

from replica_init import _fingerprint, model_fingerprint
from toy_models import ToyNet


def _model(seed: int = 0) -> ToyNet:
    torch.manual_seed(seed)
    return ToyNet()


def test_equal_models_equal_fingerprints() -> None:
    assert model_fingerprint(_model()) == model_fingerprint(_model())
    assert model_fingerprint(_model(0)) != model_fingerprint(_model(1))


def _flip_first_bit(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.view(torch.uint8).view(-1)[0] ^= 1


@pytest.mark.parametrize("target", ["blocks.0.mlp.2.bias", "noise", "scale"])
def test_one_flipped_bit_changes_fingerprint(target: str) -> None:
    model = _model()
    before = model_fingerprint(model)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    _flip_first_bit(tensors[target])
    assert model_fingerprint(model) != before


def test_non_persistent_buffers_are_covered() -> None:
    model = _model()
    assert "noise" not in model.state_dict()
    keys = [key for key, _ in _fingerprint.tensor_digests(model)]
    assert any(key.startswith("buffer:noise|") for key in keys)


def test_dtype_and_name_are_part_of_the_fingerprint() -> None:
    model = _model()
    before = model_fingerprint(model)
    model.scale = torch.ones(8, dtype=torch.float64)
    assert model_fingerprint(model) != before


def test_chunking_does_not_change_the_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    whole = model_fingerprint(model)
    monkeypatch.setattr(_fingerprint, "CHUNK_BYTES", 7)
    assert model_fingerprint(model) == whole


def test_meta_tensors_are_rejected() -> None:
    with torch.device("meta"):
        model = ToyNet()
    with pytest.raises(ValueError, match="is on the meta device and has no data to fingerprint"):
        model_fingerprint(model)
