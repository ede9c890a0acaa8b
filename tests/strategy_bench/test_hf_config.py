"""``estimate --hf-config``: a Hugging Face config.json in one command, and the training cost."""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from bench_cli import exit_code
from strategy_bench import main

transformers = pytest.importorskip("transformers")

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}
"""A small causal LM of each family (no download: the test writes its config.json)."""

FACTORY = """
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def model(config):
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config))


def batch(batch_size, device, generator):
    ids = torch.randint(0, 256, (batch_size, 32), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids, "use_cache": False}
"""
"""The same model and batches as ``--hf-config ... --seq-len 32``, written by a user."""


def _config(folder: Path, kind: str = "llama", **extra: Any) -> Path:
    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "gpt-neox": transformers.GPTNeoXConfig,
    }
    fields = dict(SMALL, **extra)
    if kind != "gpt-neox":
        fields["num_key_value_heads"] = 2
    classes[kind](**fields).save_pretrained(folder)
    return folder


def _estimate(out: Path, *args: str) -> dict[str, Any]:
    common = ["--batch-size", "2", "--gpu", "H100", "--jobs", "1", "--out", str(out)]
    assert main(["estimate", *args, *common]) == 0
    return json.loads((out / "estimate.json").read_text())  # type: ignore[no-any-return]


def test_a_config_estimates_as_the_same_model_given_as_a_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peak and predicted step of every point equal the user-factory spelling's (1%)."""
    config = _config(tmp_path / "llama-small")
    (tmp_path / "hf_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    points = ["--world-size", "2", "8", "--strategies", "ddp", "fsdp"]
    by_config = _estimate(tmp_path / "a", "--hf-config", str(config), "--seq-len", "32", *points)
    by_factory = _estimate(
        tmp_path / "b",
        *(
            "--model-factory",
            "hf_factory:model",
            "--init-params",
            json.dumps({"config": str(config)}),
        ),
        *("--input-factory", "hf_factory:batch", "--tokens-per-sample", "32"),
        *points,
    )
    ours = {(r["strategy"], json.dumps(r["knobs"]), r["world_size"]): r for r in by_config["rows"]}
    theirs = {
        (r["strategy"], json.dumps(r["knobs"]), r["world_size"]): r for r in by_factory["rows"]
    }
    assert set(ours) == set(theirs) and len(ours) >= 4
    for key, row in ours.items():
        assert row["status"] == "ok" and row["model"] == "llama-small", row
        assert row["tokens_per_sample"] == 32
        assert row["peak_bytes"] == pytest.approx(theirs[key]["peak_bytes"], rel=0.01), key
        step = theirs[key]["predicted_step_ms"]
        assert row["predicted_step_ms"] == pytest.approx(step, rel=0.01), key
        assert row["predicted_tokens_per_s_per_gpu"] > 0


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gpt-neox"])
def test_each_family_estimates_with_its_own_blocks(tmp_path: Path, kind: str) -> None:
    config = _config(tmp_path / kind, kind)
    args = ["--hf-config", str(config / "config.json"), "--world-size", "8", "--strategies", "fsdp"]
    payload = _estimate(tmp_path / "out", *args)
    (row, *_) = payload["rows"]
    assert row["status"] == "ok" and row["model"] == kind
    assert row["tokens_per_sample"] == SMALL["max_position_embeddings"]  # the default, capped
    # every decoder layer is its own FSDP unit (transformers' _no_split_modules), gathered in
    # the forward and again in the backward; the root (embeddings, norm, head) once, kept
    # through the backward; a reduce-scatter each
    layers = SMALL["num_hidden_layers"]
    calls = {"all_gather": 2 * layers + 1, "reduce_scatter": layers + 1}
    assert row["comm_calls_per_step"] == calls
    assert row["predicted_step_ms"] > 0 and row["predicted_tokens_per_s_per_gpu"] > 0


def test_the_cost_of_training_follows_each_rows_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Days, GPU-hours and cost are the row's predicted tokens/s per GPU, worked out; the plan
    names the fastest and the cheapest recommendation that fits. With a GPU failing every M
    hours, each row's failures and its length when each restarts the job (1,500 s lost: the
    restart and half a checkpoint interval) or heals one group (torchft: heal_s over the
    groups, plus the step discarded), failures during the loss included."""
    tokens, price, mtbf = 1e12, 2.5, 20_000.0
    config = _config(tmp_path / "llama-small")
    payload = _estimate(
        tmp_path / "out",
        *("--hf-config", str(config), "--seq-len", "64", "--world-size", "64", "128"),
        *("--train-tokens", "1e12", "--gpu-hour-price", "2.5", "--gpu-mtbf-hours", "20000"),
        *("--checkpoint-every-s", "1800", "--restart-s", "600", "--heal-s", "60"),
    )
    costed = [row for row in payload["rows"] if row.get("train_days")]
    assert {row["world_size"] for row in costed} == {64, 128}
    for row in costed:
        per_gpu = row["predicted_tokens_per_s_per_gpu"]
        seconds = tokens / (per_gpu * row["world_size"])
        assert math.isclose(row["train_days"], seconds / 86_400, rel_tol=1e-9)
        assert math.isclose(row["train_gpu_hours"], seconds * row["world_size"] / 3_600)
        assert math.isclose(row["train_cost"], row["train_gpu_hours"] * price)
        world, rate = row["world_size"], row["world_size"] / (mtbf * 3_600)
        assert math.isclose(row["failures"], rate * seconds)
        restart = seconds / (1 - rate * (600 + 1800 / 2))
        assert math.isclose(row["restart_days"], restart / 86_400)
        assert math.isclose(row["restart_gpu_hours"], restart * world / 3_600)
        groups = {"ddp": world, "hsdp": world // 8, "fsdp": None}[row["strategy"]]
        assert row["replica_groups"] == groups
        if groups is None:
            assert row["heal_days"] is None
        else:
            heal = seconds / (1 - rate * (60 / groups + row["predicted_step_ms"] / 1e3))
            assert math.isclose(row["heal_days"], heal / 86_400)
            assert row["heal_days"] < row["restart_days"]
    assert payload["training"]["failures"]["gpu_mtbf_hours"] == mtbf
    chosen = [entry for entry in payload["recommendation"] if entry["strategy"]]
    (plan,) = payload["training"]["plan"]
    assert plan["fastest"]["train_days"] == min(entry["train_days"] for entry in chosen)
    cheapest = min(entry["train_gpu_hours"] for entry in chosen)
    assert plan["cheapest"]["train_gpu_hours"] == cheapest
    out = capsys.readouterr().out
    assert "days" in out and "GPU-hours" in out and "fastest that fits:" in out
    assert "with failures (a GPU fails every 20,000 hours" in out and "heal: days" in out
    for strategy in ("ddp", "fsdp", "hsdp"):
        assert any(line.split()[2:3] == [strategy] for line in out.splitlines()), strategy


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hf-config", "/nonexistent"], "/nonexistent does not exist"),
        (["--hf-config", "CONFIG", "--seq-len", "4096"], "longer than the config's max_position"),
        (
            ["--hf-config", "CONFIG", "--model-factory", "x:y", "--input-factory", "x:z"],
            "--hf-config builds the model and its input",
        ),
        (["--hf-config", "CONFIG", "--tokens-per-sample", "8"], "set --seq-len instead"),
        (["--hf-config", "NOTYPE"], "has no 'model_type'"),
        (["--hf-config", "UNKNOWN"], "transformers cannot read it (ValueError: "),
        (["--hf-config", "T5"], "'t5' is not a causal language model transformers can build"),
        (["--train-tokens", "1e12"], "--train-tokens 1e+12 needs a predicted rate"),
        (["--gpu", "H100", "--train-tokens", "0"], "--train-tokens must be a token count"),
        (["--gpu", "H100", "--train-tokens", "nan"], "--train-tokens must be a token count"),
        (["--gpu", "H100", "--gpu-hour-price", "2"], "add it"),
        (
            ["--gpu", "H100", "--train-tokens", "1e9", "--gpu-hour-price", "-1"],
            "--gpu-hour-price must be a finite price >= 0",
        ),
        (["--gpu", "H100", "--gpu-mtbf-hours", "5e4"], "--gpu-mtbf-hours 50000 prices failures"),
        (
            ["--gpu", "H100", "--train-tokens", "1e9", "--gpu-mtbf-hours", "0"],
            "--gpu-mtbf-hours must be a finite number > 0, got 0",
        ),
        (
            ["--gpu", "H100", "--train-tokens", "1e9", "--gpu-mtbf-hours", "9", "--heal-s", "inf"],
            "--heal-s must be a finite number > 0, got inf",
        ),
    ],
)
def test_bad_input_is_one_line_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    config = _config(tmp_path / "cfg")
    (tmp_path / "notype.json").write_text(json.dumps({"hidden_size": 8}))
    unknown = json.loads((config / "config.json").read_text()) | {"model_type": "no-such-model"}
    (tmp_path / "unknown.json").write_text(json.dumps(unknown))
    t5 = tmp_path / "t5"  # an encoder-decoder: no causal LM class
    transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2).save_pretrained(t5)
    named = {
        "CONFIG": str(config),
        "NOTYPE": str(tmp_path / "notype.json"),
        "UNKNOWN": str(tmp_path / "unknown.json"),
        "T5": str(t5),
    }
    args = [named.get(arg, arg) for arg in args]
    out = tmp_path / "out"
    assert exit_code(["estimate", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_without_transformers_the_flag_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path / "cfg")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    args = ["estimate", "--hf-config", str(config), "--out", str(tmp_path / "out")]
    assert exit_code(args) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'strategy-bench[hf]'" in err and len(err.splitlines()) == 1, err


def test_the_readmes_first_command_prints_the_readmes_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a new user copies from the README's first screen prints the table shown there."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    command = re.search(r"nox -s estimate -- ((?:[^\n]*\\\n)*[^\n]*)\n", readme)
    assert command is not None
    args = shlex.split(command.group(1).replace("\\\n", " "))
    shown = re.search(r"```text\n(training .*?)```", readme, re.S)
    assert shown is not None
    root = Path(__file__).resolve().parents[2]
    args = [str(root / arg) if arg.startswith("docs/") else arg for arg in args]
    # --jobs 1: in this process (the figures do not depend on it; no pool to start)
    assert main(["estimate", *args, "--jobs", "1", "--out", str(tmp_path / "out")]) == 0
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    for line in shown.group(1).strip().splitlines():
        assert line.rstrip() in printed, line
