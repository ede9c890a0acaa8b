"""prepare_model(pretrained=...) with transformers' own models and its own from_pretrained.

Tiny Llama and GPT-2 (tied head) models are built from a config (no download), saved by
transformers, loaded shard-on-read into 2-rank FSDP and DDP models made by prepare_model,
trained one step, written by hf_io.save_pretrained and read back by transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_io import consolidate_checkpoint
from dist_harness import run_ranks
from hf_io_workers import FACTORIES, round_trip, tokens

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pretrained")
    for name, (factory, config) in FACTORIES.items():
        torch.manual_seed(1)
        factory(**config).save_pretrained(root / name / "original")
    return root


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if "safetensors" in p.name}


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_pretrained_round_trip_with_transformers(originals: Path, strategy: str) -> None:
    """Loaded bit for bit (ties kept, buffers the constructor's), trained, saved by every rank's
    part, read by from_pretrained with no missing key and the same logits; the offline export
    of a checkpoint of the same run writes the same bytes."""
    from transformers import AutoModelForCausalLM  # installed by nox: never skipped

    run_ranks(round_trip, str(originals), strategy)
    results = torch.load(originals / f"result-{strategy}.pt", weights_only=True)
    for name, (_, config) in FACTORIES.items():
        folder = originals / name
        original = load_file(folder / "original" / "model.safetensors")
        result = results[name]
        reference = AutoModelForCausalLM.from_pretrained(folder / "original")
        for key, value in reference.state_dict().items():
            assert torch.equal(result["loaded"][key], value), (name, key)
        for key, value in original.items():
            assert torch.equal(result["loaded"][key], value), (name, key)
        for key, value in reference.named_buffers():  # rotary tables: not in the file
            assert torch.equal(result["buffers"][key], value), (name, key)
        assert result["tied"] == (name == "gpt2")

        trained, info = AutoModelForCausalLM.from_pretrained(
            folder / f"trained-{strategy}", output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert (folder / f"trained-{strategy}" / "model.safetensors.index.json").is_file()
        with torch.no_grad():
            logits = trained(tokens(config["vocab_size"])).logits
        assert torch.equal(logits, result["logits"]), (
            name,
            (logits - result["logits"]).abs().max(),
        )
        if name == "gpt2":
            assert trained.lm_head.weight is trained.transformer.wte.weight

        exported = consolidate_checkpoint(
            folder / f"ckpt-{strategy}",
            folder / f"export-{strategy}",
            max_shard_size="20KB",
            config_from=folder / "original",
        )
        assert _files(exported) == _files(folder / f"trained-{strategy}")
