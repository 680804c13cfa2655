"""Everything a checkpoint holds and a rollback restores, in one object: the model and optimizer
(through their placements: this rank's pieces of the single-process tensors), the data position
(the sampler's step), the step count, the fp16 loss scaler, the spike window and the CPU RNG.
Checkpoints written by one layout load into any other (docs/checkpoints.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core.config import Config, to_dict
from ..core.layout import Layout
from ..parallel import Parallelized
from . import checkpoint as ckpt
from .optim import LossScaler

if TYPE_CHECKING:  # DCP is imported on the first save or load only (checkpoint/pieces.py)
    from torch.distributed.checkpoint.stateful import Stateful


class TrainState:
    """`spikes`: the loss-spike window (resilience/spike.SpikeDetector), held as anything with
    state_dict / load_state_dict, so that the state sits below what observes and acts on it."""

    def __init__(self, par: Parallelized, sampler, scaler: LossScaler, spikes: Stateful,
                 cfg: Config, layout: Layout, rank: int, outer=None, island: int = 0, island_job: int | None = None):
        """`island_job`: island jobs (training.outer.on_island_loss = "continue"): this island, which saves
        its own state as island 0's (docs/diloco.md)."""
        self.par, self.sampler, self.scaler, self.spikes = par, sampler, scaler, spikes
        self.cfg, self.layout, self.rank = cfg, layout, rank
        self.outer, self.island = outer, island  # parallel.islands > 1: the OuterSync, this rank's island
        self.island_job = island_job
        self.step = 0  # optimizer steps taken
        self.saved_step: int | None = None  # newest checkpoint written or loaded (for messages)

    def pieces(self, island: int | None = None, outer: bool = True
               ) -> tuple[dict[str, ckpt.Pieces], dict[str, tuple[int, ...]]]:
        """This rank's pieces of every checkpoint tensor (views of its own optimizer state, placed by
        the placement records; the model-state buffers, Parallelized.model_state), and the full shape
        of every key, in model order. With islands (docs/diloco.md, "Checkpoints"), island i's state is
        under `island{i}/` (island 0's under the plain keys), and θ_outer and its momentum under `outer/`
        (`outer`: with them); `island`: whose keys this rank reads or writes (default: its own)."""
        state, shapes = {}, {}
        places, opt = self.par.placements, self.par.optimizer
        island = self.island if island is None else island
        prefix = f"island{island}/" if island else ""
        for name, kind, t in opt.state_storage():
            pl = places[name]
            key = f"{prefix}{kind}/{name}"
            # offload = "nvme": `t` stands for a stretch of a state file, read and written through it
            state[key] = ckpt.Pieces(pl.full_shape, torch.float32,
                                     [(b.offsets, v) for b, v in pl.pieces(t)], pl.owner,
                                     opt.backing(name, kind) if t.is_meta else None)
            shapes[key] = pl.full_shape
        for name, t in self.par.model_state().items():  # whole on each holder; one copy per stage writes
            key = f"{prefix}master/{name}"
            state[key] = ckpt.Pieces(tuple(t.shape), torch.float32, [((0,) * t.dim(), t)], self.par.state_writer)
            shapes[key] = tuple(t.shape)
        for kind, tensors in (self.outer.storage() if self.outer is not None and outer else []):
            for name, t in tensors.items():  # laid out like the masters; island 0's owners write them
                pl = places[name]
                state[f"outer/{kind}/{name}"] = ckpt.Pieces(pl.full_shape, torch.float32,
                                                            [(b.offsets, v) for b, v in pl.pieces(t)],
                                                            pl.owner and self.island == 0)
                shapes[f"outer/{kind}/{name}"] = pl.full_shape
        rng = torch.get_rng_state()
        state["rng/cpu"] = ckpt.Pieces(tuple(rng.shape), rng.dtype, [((0,), rng)], self.rank == 0)
        return state, shapes

    def meta(self) -> dict:
        """What meta.json holds besides the tensors."""
        return {**self.position(), "layout": self.layout.shape(), "accum": self.layout.accum,
                "config": to_dict(self.cfg), **({} if self.island_job is None else {"island_job": self.island_job}),
                **({"outer_pending": self.outer.pending_meta()} if self.outer is not None and self.outer.pending else {})}

    def save(self, checkpointer: ckpt.Checkpointer, extra: dict | None = None) -> dict:
        """Write a checkpoint of this step (`extra`: more meta.json entries); what the save reports."""
        if self.outer is not None:
            self.outer.settle()  # delayed outer syncs in flight: their means go into the checkpoint
        out = checkpointer.save(self.step, self.pieces()[0], {**self.meta(), **(extra or {})})
        if "error" not in out:  # checkpoint.on_error = "continue": the next due step tries again
            self.saved_step = self.step
        return out

    def load(self, path: str) -> dict:
        """Every piece from the checkpoint at `path` (written by any layout); its meta.json. Islands: a
        checkpoint of another island count (ckpt.check_islands allowed it) keeps the islands it has."""
        ckpt.check_islands(self.cfg, path)
        # an island job's checkpoint holds one island's state under the plain keys, and θ_outer
        written_meta = ckpt.meta_of(path)
        by_job = written_meta.get("island_job") is not None
        if self.outer is not None:  # training.outer.delay: the means that were in flight
            self.outer.expect_pending(written_meta.get("outer_pending", {}))
        written = 1 if by_job else ckpt.islands_of(path)
        # an island the checkpoint has reads its own state, a new one island 0's (docs/diloco.md, "Checkpoints")
        state, shapes = self.pieces(self.island if self.island < written else 0, outer=written > 1 or by_job)
        meta = ckpt.load(path, state, shapes)
        if self.outer is not None and written == 1 and not by_job:  # DiLoCo from an ordinary checkpoint:
            self.outer.restart_from_masters()  # θ_outer = its masters
        elif self.outer is not None and self.island >= written:  # an island (re)joins from θ_outer
            self.outer.rejoin()
        torch.set_rng_state(state["rng/cpu"].parts[0][1])
        self.set_position(meta)
        self.saved_step = self.step
        return meta

    def position(self) -> dict:
        """Where training stands besides the tensors: what an island joining takes from its donor
        (parallel/dims/island_link.py), and what meta.json holds of it."""
        return {"step": self.step, "sampler": self.sampler.state_dict(), "scaler": self.scaler.state_dict(),
                "optimizer_step": self.par.optimizer.step_count(), "spikes": self.spikes.state_dict()}

    def set_position(self, meta: dict) -> None:
        self.par.optimizer.loaded(meta["optimizer_step"])
        self.sampler.load_state_dict(meta["sampler"])
        self.scaler.load_state_dict(meta["scaler"])
        self.spikes.load_state_dict(meta.get("spikes"))
        self.step = int(meta["step"])

    def rollback(self, path: str) -> tuple[int, int]:
        """Load the checkpoint at `path` but keep the data position: the global batches read since
        it (the first and last data position, returned) are never trained on."""
        end = self.sampler.state_dict()["step"]
        self.load(path)
        first = self.sampler.state_dict()["step"]
        self.sampler.load_state_dict({**self.sampler.state_dict(), "step": end})
        return first, end - 1
