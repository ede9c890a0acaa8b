"""``WorkloadSpec``: a workload named by plain, picklable values (it travels to ranks)."""

from __future__ import annotations

import dataclasses

from strategy_bench.workload._hf import hf_workload
from strategy_bench.workload._workload import Workload, preset_workload, user_workload


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """A preset name, a Hugging Face ``config.json``, or the user's factories as strings."""

    preset: str | None = None
    hf_config: str | None = None
    seq_len: int | None = None
    model_factory: str | None = None
    init_params: str | None = None
    input_factory: str | None = None
    trainable: str | None = None
    scale: tuple[str, int] | None = None
    tokens_per_sample: int | None = None

    def build(self) -> Workload:
        """The workload this spec names, with ``scale``'s init parameter set if given."""
        if self.preset is not None:
            workload = preset_workload(self.preset, seq_len=self.seq_len)
        elif self.hf_config is not None:
            workload = hf_workload(self.hf_config, self.seq_len)
        else:
            assert self.model_factory is not None and self.input_factory is not None
            workload = user_workload(
                self.model_factory,
                self.init_params,
                self.input_factory,
                self.trainable,
                tokens_per_sample=self.tokens_per_sample,
            )
        if self.scale is None:
            return workload
        name, value = self.scale
        return dataclasses.replace(
            workload,
            init_params={**workload.init_params, name: value},
            flops_per_sample=None,  # the preset's formula is for its own size
        )
