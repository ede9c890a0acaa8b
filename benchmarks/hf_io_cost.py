"""What loading Hugging Face weights costs, beside the libraries users would use instead.

A Llama of about 520 MB (fp32, untied head) is written once by transformers' own
``save_pretrained``. Then, alternating the order each round and repeating:

- one process: ``prepare_model(..., pretrained=DIR)`` (a one-rank group, DDP, no verify)
  beside transformers' ``AutoModelForCausalLM.from_pretrained(DIR)``;
- two gloo ranks, FSDP2: ``prepare_model(..., pretrained=DIR)`` beside DCP's
  ``HuggingFaceStorageReader`` loading into the same ``fully_shard``ed model (built on meta,
  given storage with ``to_empty``), with each rank's host RSS growth (sampled every 5 ms)
  against the bound: half the model + its largest tensor + 96 MiB.

Writes ``hf_io_cost.json`` and ``README.md`` into ``--out``::

    python benchmarks/hf_io_cost.py --rounds 3 --out docs/results/hf-io

Needs transformers, safetensors and this repository's packages importable.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIG = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 5,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
MIB = 2**20


def llama(**_: Any) -> torch.nn.Module:
    """The benchmark's Llama, from its config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _rank(rank: int, world: int, store: str, folder: str, way: str, queue: Any) -> None:
    from dist_core import MemoryPeak
    from distributed_strategy import prepare_model

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        dist.barrier()
        peak = MemoryPeak(torch.device("cpu"), interval=0.005)
        start = time.perf_counter()
        with peak:
            if way == "hf_io":
                model = prepare_model(
                    llama,
                    None,
                    config="fsdp",
                    device="cpu",
                    default_dtype=torch.float32,
                    seed=0,
                    verify=False,
                    pretrained=folder,
                )
            else:
                model = _dcp_hf_load(folder)
            dist.barrier()
        seconds = time.perf_counter() - start
        checksum = float(sum(p.detach().to_local().double().sum() for p in model.parameters()))
        queue.put((rank, seconds, peak.host_growth, checksum))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _dcp_hf_load(folder: str) -> torch.nn.Module:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    state = {k: v for k, v in model.state_dict().items() if k in _saved_names(folder)}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(folder))
    return model


def _saved_names(folder: str) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as reader:
            names.update(reader.keys())
    return names


def _two_ranks(folder: str, way: str) -> list[tuple[int, float, int, float]]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            context.Process(target=_rank, args=(r, 2, store, folder, way, queue)) for r in range(2)
        ]
        for proc in procs:
            proc.start()
        results = sorted(queue.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    return results


def _one_process(folder: str, way: str) -> float:
    code = f"""
import time, torch, torch.distributed as dist, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from hf_io_cost import llama
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
start = time.perf_counter()
if {way!r} == "hf_io":
    from distributed_strategy import prepare_model
    prepare_model(llama, None, config="ddp", device="cpu", default_dtype=torch.float32, seed=0,
                  verify=False, pretrained={folder!r})
else:
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained({folder!r})
print(time.perf_counter() - start)
dist.destroy_process_group()
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run the comparison and write its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "llama")
        torch.manual_seed(0)
        model = llama()
        model.save_pretrained(folder)
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
        del model
        one: dict[str, list[float]] = {"hf_io": [], "transformers": []}
        two: dict[str, list[Any]] = {"hf_io": [], "dcp_hf_reader": []}
        for round_ in range(args.rounds):
            order = ["hf_io", "transformers"][:: 1 if round_ % 2 == 0 else -1]
            for way in order:
                one[way].append(_one_process(folder, way))
            for way in ["hf_io", "dcp_hf_reader"][:: 1 if round_ % 2 == 0 else -1]:
                two[way].append(_two_ranks(folder, way))
            sys.stderr.write(f"round {round_ + 1}/{args.rounds} done\n")
    bound = size / 2 + largest + 96 * MIB
    report = _report(one, two, size, largest, bound)
    (args.out / "hf_io_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "README.md").write_text(_table(report))
    sys.stdout.write(_table(report))


def _report(
    one: dict[str, list[float]], two: dict[str, list[Any]], size: int, largest: int, bound: float
) -> dict[str, Any]:
    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    checksums = {way: {r[3] for runs in rounds for r in runs} for way, rounds in two.items()}
    return {
        "torch": torch.__version__,
        "model_bytes": size,
        "largest_tensor_bytes": largest,
        "rss_bound_bytes": bound,
        "one_process_s": {way: spread(v) for way, v in one.items()},
        "two_ranks_s": {
            way: spread([max(r[1] for r in runs) for runs in v]) for way, v in two.items()
        },
        "two_ranks_rss_growth_bytes": {
            way: max(r[2] for runs in v for r in runs) for way, v in two.items()
        },
        "same_weights": len(checksums["hf_io"] | checksums["dcp_hf_reader"]) == 2,
    }


def _table(report: dict[str, Any]) -> str:
    one, two, rss = (
        report["one_process_s"],
        report["two_ranks_s"],
        report["two_ranks_rss_growth_bytes"],
    )

    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})"

    lines = [
        "# hf-io: the cost of loading Hugging Face weights",
        "",
        f"A Llama of {report['model_bytes'] / MIB:.0f} MiB (fp32, largest tensor "
        f"{report['largest_tensor_bytes'] / MIB:.0f} MiB), saved by transformers; CPU, gloo, "
        f"torch {report['torch']}. Median (min-max) of the rounds, the order alternated.",
        "Command: `python benchmarks/hf_io_cost.py --rounds 3 --out docs/results/hf-io`.",
        "",
        "| case | hf-io | baseline | ratio |",
        "| --- | --- | --- | --- |",
        f"| one process: prepare_model(pretrained=) vs transformers from_pretrained | "
        f"{cell(one['hf_io'])} | {cell(one['transformers'])} | "
        f"{one['hf_io']['median'] / one['transformers']['median']:.2f}x |",
        f"| 2 FSDP ranks: prepare_model(pretrained=) vs DCP HuggingFaceStorageReader | "
        f"{cell(two['hf_io'])} | {cell(two['dcp_hf_reader'])} | "
        f"{two['hf_io']['median'] / two['dcp_hf_reader']['median']:.2f}x |",
        f"| 2 FSDP ranks: largest host RSS growth of a rank | {rss['hf_io'] / MIB:.0f} MiB | "
        f"{rss['dcp_hf_reader'] / MIB:.0f} MiB | "
        f"{rss['hf_io'] / max(rss['dcp_hf_reader'], 1):.2f}x |",
        "",
        f"Bound per rank (half the model + the largest tensor + 96 MiB): "
        f"{report['rss_bound_bytes'] / MIB:.0f} MiB; hf-io "
        f"{'within' if rss['hf_io'] <= report['rss_bound_bytes'] else 'OVER'} it. Both ways "
        f"loaded the same weights: {report['same_weights']}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
