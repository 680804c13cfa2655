"""Failure injection for the test suite: a MESHLM_PLUGINS module (src/meshlm/train/plugins.py). The
tests that use it set MESHLM_PLUGINS=fault_plugin, put tests/ on PYTHONPATH (`plugin_env`) and say
what to inject through these variables:
MESHLM_TEST_NAN_STEP=N       step N's loss becomes NaN (as the non-finite guard sees it)
MESHLM_TEST_STEP_SLEEP=S     sleep S seconds in every step (gives a test time to kill a worker)
MESHLM_TEST_KILL_IN_SAVE=N:R rank R SIGKILLs itself while checkpoint N is half written (first attempt)
MESHLM_TEST_SLOW_RANK=R:S    rank R sleeps S seconds inside every step (a straggler)
MESHLM_TEST_CORRUPT_BATCH=N  global batch N (0-based data position) becomes random tokens, the same
                             in every layout (a corrupt shard: what the spike guard is for)
MESHLM_TEST_HOLD_ALONE=N     a job on one rank waits after step N until it is ended (a shrunk
                             elastic job stays alive, at a known step, until the lost node is back)
MESHLM_TEST_SIGNAL=R:N:NAME rank R sends itself signal NAME (e.g. SIGTERM) while it runs step N
MESHLM_TEST_KILL_AT=R:N        rank R SIGKILLs itself as it starts step N, in its first launch (an island
                             job started again is a later incarnation on the island link: it goes on)
MESHLM_TEST_HOLD_FOR_ISLAND=K:N   island jobs: a rank waits before step N until island K's second start is
                             taken in (a restarted island then rejoins before the others finish)
MESHLM_TEST_ABORT_AT_EXIT=R  rank R aborts (SIGABRT) at interpreter exit, after its run finished and
                             its teardown: the exit abort the launcher must tell from a failed run
MESHLM_TEST_DEAR_AT=N:S:PATH  rank 0 rewrites the energy trace PATH as checkpoint N is written (just before
                             the run's energy plan of that step): cheap until now, S seconds expensive, then an
                             hour cheap (tests/test_energy_schedule.py: a pause placed by an event, not a clock)
MESHLM_TEST_SECONDS_PER_MICROBATCH=S0,S1,...  rank R is a slower card: before each step it sleeps S_R
                             seconds for each micro-batch it runs (the runtime's own count: its layout's
                             accumulation), and writes each step's measured sleep and runner seconds to
                             run_dir/card_times_rank<R>.jsonl (tests/test_plan_hetero_cpu.py); no
                             planner code prices the delay. The first step (start-up, which the tests
                             leave out) runs without delay: its sleeps measured nothing
MESHLM_TEST_SECONDS_PER_BLOCK=S0,S1,...  the same slower cards inside the step: each block's forward
                             sleeps S_R seconds, its backward twice that (a pipeline stage is then as
                             slow as its card, block by block; the head runs at the CPU's own pace),
                             written as above
"""
from __future__ import annotations

import atexit
import os
import signal
import time

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(TESTS), "src")


def plugin_env(**variables: str) -> dict:
    """What a launched `meshlm train` needs in its environment to run this plugin with `variables`."""
    return {"PYTHONPATH": os.pathsep.join([SRC, TESTS]), "MESHLM_PLUGINS": "fault_plugin", **variables}


def install(trainer) -> None:
    env, rank = os.environ, trainer.ctx.rank
    sleep = float(env.get("MESHLM_TEST_STEP_SLEEP", "0") or 0)
    slow = env.get("MESHLM_TEST_SLOW_RANK", "")
    if slow and int(slow.split(":")[0]) == rank:
        sleep += float(slow.split(":")[1])
    hold = int(env.get("MESHLM_TEST_HOLD_ALONE", "0") or 0) if trainer.ctx.world_size == 1 else 0
    nan_step = int(env.get("MESHLM_TEST_NAN_STEP", "0") or 0)
    kill = env.get("MESHLM_TEST_KILL_IN_SAVE", "")
    corrupt = int(env.get("MESHLM_TEST_CORRUPT_BATCH", "-1") or -1)
    state = trainer.state
    sig = env.get("MESHLM_TEST_SIGNAL", "").split(":")
    sig_step = int(sig[1]) if len(sig) == 3 and int(sig[0]) == rank else 0
    kill_at = env.get("MESHLM_TEST_KILL_AT", "").split(":")
    rounds = getattr(trainer, "rounds", None)  # island jobs: a restarted island is a later incarnation
    hold_for = env.get("MESHLM_TEST_HOLD_FOR_ISLAND", "").split(":")
    hold_step = int(hold_for[1]) if len(hold_for) == 2 and rounds is not None and rounds.link.incarnation == 1 else 0
    kill_step = int(kill_at[1]) if len(kill_at) == 2 and int(kill_at[0]) == rank and trainer.ctx.restarts == 0 \
        and (rounds is None or rounds.link.incarnation == 1) else 0

    def before() -> None:
        while hold and state.step >= hold:
            time.sleep(0.1)  # the agent's restart (or SIGTERM) ends it here
        time.sleep(sleep)
        if state.step + 1 == sig_step:
            os.kill(os.getpid(), signal.Signals[sig[2]])
        if state.step + 1 == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        while state.step + 1 == hold_step and not rounds.link.store.check([f"admitted/{hold_for[0]}/2"]):
            time.sleep(0.05)

    def after(loss_sum: torch.Tensor) -> torch.Tensor:
        return loss_sum + float("nan") if state.step + 1 == nan_step else loss_sum

    if sleep or hold or nan_step or sig_step or kill_step or hold_step:
        trainer.runner = Wrapped(trainer.runner, before, after)
    if kill and trainer.ctx.restarts == 0:
        at = tuple(int(x) for x in kill.split(":"))
        trainer.checkpointer.on_written = lambda step: (step, rank) == at and os.kill(os.getpid(), signal.SIGKILL)
    dear = env.get("MESHLM_TEST_DEAR_AT", "").split(":", 2)
    if len(dear) == 3 and rank == 0:
        trainer.checkpointer.on_written = lambda step: step == int(dear[0]) and dear_now(dear[2], float(dear[1]))
    if env.get("MESHLM_TEST_ABORT_AT_EXIT", "") == str(rank):
        atexit.register(os.abort)
    per_mb = env.get("MESHLM_TEST_SECONDS_PER_MICROBATCH", "")
    if per_mb:
        trainer.runner = SlowCard(trainer, float(per_mb.split(",")[rank]))
    per_block = env.get("MESHLM_TEST_SECONDS_PER_BLOCK", "")
    if per_block:
        trainer.runner = SlowBlocks(trainer, float(per_block.split(",")[rank]))
    if corrupt >= 0:
        trainer.data = CorruptData(trainer.data, corrupt, trainer.cfg.training.global_batch, trainer.args.vocab_size)


def dear_now(path: str, seconds: float) -> None:
    """The trace at `path` from now: expensive for `seconds`, then an hour cheap (written whole, then moved)."""
    from datetime import datetime, timezone
    now = time.time()
    rows = [(now - 3600, 10), (now, 100), (now + seconds, 10), (now + seconds + 3600, 10)]
    with open(path + ".tmp", "w") as f:
        f.write("time,price\n" + "".join(f"{datetime.fromtimestamp(t, timezone.utc).isoformat()},{v}\n" for t, v in rows))
    os.replace(path + ".tmp", path)


class Wrapped:
    """A step runner (parallel/step.py) that calls `before()` ahead of each step and passes its loss
    through `after`."""

    def __init__(self, inner, before, after):
        self.inner, self.before, self.after = inner, before, after

    def run(self, batch, scale=1.0, timed=False):
        self.before()
        return self.after(self.inner.run(batch, scale, timed))

    def eval_loss(self, batch):
        return self.inner.eval_loss(batch)


class CorruptData:
    """The training data with global batch `position` replaced by random tokens."""

    def __init__(self, data, position: int, global_batch: int, vocab: int):
        self.data, self.position, self.global_batch, self.vocab = data, position, global_batch, vocab

    def __getattr__(self, name):
        return getattr(self.data, name)

    def next_batch(self, dp_rank: int, dp_size: int, split: tuple[int, ...] = ()):
        position = self.data.sampler.state_dict()["step"]
        batch = self.data.next_batch(dp_rank, dp_size, split)
        if position != self.position:
            return batch
        g = torch.Generator().manual_seed(1000 + position)  # this rank's slice of one seeded global batch
        rows = torch.randint(0, self.vocab, (self.global_batch, batch.inputs.shape[1] + 1), generator=g)
        split = split or (self.global_batch // dp_size,) * dp_size  # parallel.dp_weights: uneven runs
        rows = rows[sum(split[:dp_rank]):sum(split[:dp_rank + 1])]
        return type(batch)(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), batch.docs)


class SlowCard:
    """A step runner on a card `seconds_per_mb` slow per micro-batch: it sleeps that long for each of
    this rank's micro-batches first, then runs the step; each step's measured sleep and the runner's own
    seconds (its compute plus the time it waits for the other replicas in the gradient all-reduce) go
    to run_dir/card_times_rank<R>.jsonl."""

    def __init__(self, trainer, seconds_per_mb: float):
        import json
        self.micro_batches = trainer.layout.accum_of(trainer.ctx.index("dp"))
        self.inner, self.delay, self.json = trainer.runner, seconds_per_mb * self.micro_batches, json
        self.path = os.path.join(trainer.run_dir, f"card_times_rank{trainer.ctx.rank}.jsonl")
        self.started = False  # the start-up step runs at the CPU's pace (the tests leave it out)

    def run(self, batch, scale=1.0, timed=False):
        t0 = time.perf_counter()
        if self.started:
            time.sleep(self.delay)
        self.started = True
        t1 = time.perf_counter()
        out = self.inner.run(batch, scale, timed)
        t2 = time.perf_counter()
        with open(self.path, "a") as f:
            f.write(self.json.dumps({"sleep_s": t1 - t0, "run_s": t2 - t1, "micro_batches": self.micro_batches}) + "\n")
        return out

    def eval_loss(self, batch):
        return self.inner.eval_loss(batch)


class SlowBlocks(SlowCard):
    """SlowCard's delay inside the step: a forward hook on every block sleeps `seconds` and puts a hook
    on its output's gradient that sleeps twice as long in backward, so each pipeline stage runs at its
    card's pace, micro-batch by micro-batch; the sleeps are measured as they happen."""

    def __init__(self, trainer, seconds: float):
        import json

        from meshlm.model.llama import Block
        self.inner, self.json, self.slept, self.started = trainer.runner, json, 0.0, False
        self.path = os.path.join(trainer.run_dir, f"card_times_rank{trainer.ctx.rank}.jsonl")
        for m in trainer.par.model.modules():
            if isinstance(m, Block):
                self._hook(m, seconds)

    def _hook(self, module, forward_s: float) -> None:
        def after(mod, inputs, out):
            self._sleep(forward_s)
            if out.requires_grad:
                out.register_hook(lambda grad: self._sleep(2 * forward_s))
        module.register_forward_hook(after)

    def _sleep(self, seconds: float) -> None:
        if not self.started:
            return
        t0 = time.perf_counter()
        time.sleep(seconds)
        self.slept += time.perf_counter() - t0

    def run(self, batch, scale=1.0, timed=False):
        self.slept = 0.0
        t0 = time.perf_counter()
        out = self.inner.run(batch, scale, timed)
        self.started = True
        run_s = time.perf_counter() - t0
        with open(self.path, "a") as f:
            f.write(self.json.dumps({"sleep_s": self.slept, "run_s": run_s}) + "\n")
        return out
