"""An expert cache for a mixture split between the devices: while decoding, each split layer's experts move
between the GPU's matrices and the CPU's as the stream's routings change. Every step's choices (the router's ids,
graph outputs then) add to a decayed count per expert; every `interval` steps a layer's most counted host experts
replace its least counted GPU ones where the gain exceeds `margin` routings: the newcomer's matrices are copied
from the file into the leaver's GPU slot (one expert's bytes over PCIe, about one CPU routing of it) and both
sides' slots are rewritten. The decode graph reads the slots as tensors, so it stays valid; prompt graphs, which
cut their streamed chunks from the slots when built, are dropped.

Not a user option: on an H200 it has not paid (docs/BENCHMARKS.md, "The expert cache"): reading the ids back costs
6 % of a step, each move's synchronous copies from the file's pageable pages cost about what the CPU saves, and
on local streams (windows of 32 tokens from 4 ids) it ran 0.79-1.02x static placement. What it would need: the
copies on a side stream from pinned staging, overlapped with decoding, and the ids counted where the CPU side
already reads them."""
from __future__ import annotations

import numpy as np

from pyinfer.engine.placement import EXPERT_MATRICES


class ExpertCache:
    def __init__(self, model, interval: int = 8, decay: float = 0.9, margin: float = 8.0, max_swaps: int = 2):
        self.model, self.interval, self.decay, self.margin, self.max_swaps = model, interval, decay, margin, max_swaps
        n_expert = model.config.n_expert
        self.layers = [il for il in range(model.config.n_layer) if f"blk.{il}.ffn_exps_slots.gpu" in model.weights]
        self.counts = {il: np.zeros(n_expert) for il in self.layers}
        # the GPU side's slots as the host knows them (the tensor may live on the device)
        self.gpu_slots = {il: model.weights[f"blk.{il}.ffn_exps_slots.gpu"].numpy().copy() for il in self.layers}
        self.steps = self.swaps = 0

    def observe(self, ids: dict[int, np.ndarray]) -> None:
        """A decoded token's expert ids per layer; every interval steps, the swaps that pay."""
        for il in self.layers:
            c = self.counts[il]
            c *= self.decay
            np.add.at(c, ids[il].reshape(-1), 1.0)
        self.steps += 1
        if self.steps % self.interval == 0 and self._rebalance():
            self.model.slots_changed()

    def _rebalance(self) -> bool:
        swapped = False
        for il in self.layers:
            c, slots = self.counts[il], self.gpu_slots[il]
            for _ in range(self.max_swaps):
                host, held = np.flatnonzero(slots < 0), np.flatnonzero(slots >= 0)
                e_in, e_out = host[np.argmax(c[host])], held[np.argmin(c[held])]
                if c[e_in] <= c[e_out] + self.margin:
                    break
                self._swap(il, int(e_in), int(e_out))
                swapped = True
        return swapped

    def _swap(self, il: int, e_in: int, e_out: int) -> None:
        """Expert e_in takes e_out's matrix on the GPU; the CPU computes e_out from the file again."""
        w, n_expert = self.model.weights, self.model.config.n_expert
        slots = self.gpu_slots[il]
        j = int(slots[e_out])
        for name in EXPERT_MATRICES:
            src = np.frombuffer(self.model.file.tensors[f"blk.{il}.{name}.weight"].data, np.uint8).reshape(n_expert, -1)
            w[f"blk.{il}.{name}.gpu.weight"].write(src[e_in], j * src.shape[1])
        slots[e_in], slots[e_out] = j, -1
        w[f"blk.{il}.ffn_exps_slots.gpu"].write(slots)
        cpu = w[f"blk.{il}.ffn_exps_slots.cpu"]
        cpu_slots = np.where(slots < 0, np.arange(n_expert, dtype=np.int32), -1).astype(np.int32)
        cpu.write(cpu_slots)
        self.swaps += 1
