"""`meshlm` command line: train | prepare | plan | estimate | schedule | report | explore | convert | generate."""
from __future__ import annotations

import argparse
import os
import sys


def _fail(msg: str, code: int = 2) -> int:
    print(f"meshlm: {msg}", file=sys.stderr)
    return code


def cmd_train(args, extra: list[str]) -> int:
    from . import preflight
    from .core.facts.incidents import incidents
    from .train.launch import preempted, record_error, spawn, worker_errors

    if args.link_server is not None:  # the islands' coordinator alone (docs/diloco.md, "Losing an island")
        from .train.island_jobs import serve_link
        try:
            cfg = preflight.link_server_config(args.config, extra)
        except ValueError as e:
            return _fail(str(e))
        return serve_link(args.link_server, cfg.parallel.islands, cfg.parallel.timeout_s)
    try:
        start = preflight.settle(args.config, extra, args.nproc, args.max_restarts, args.worker, args.run_dir)
    except (ValueError, RuntimeError) as e:  # ConfigErrors; training.device unknown; the world not formed
        return _fail(str(e))
    cfg, world, worker, restarts, run_dir = start.cfg, start.world, start.worker, start.restarts, start.run_dir
    if not worker or int(os.environ.get("RANK", "0")) == 0:
        preflight.write_config(start, args.config)
    if not args.worker and int(os.environ.get("RANK", "0")) == 0:
        t, attention = cfg.training, _attention(cfg, start.layout, start.asked_attn)
        print(f"meshlm: {cfg.model.preset}, {world} worker{'s' if world > 1 else ''}{_shared_gpus(cfg, world)}"
              f"{_islands(cfg, start.layout)}, "
              f"precision {t.precision}{_fp8_comm(cfg, start.layout)}, "
              f"compile {'on' if t.compile else 'off'}{attention}, "
              f"run dir {run_dir}; {_energy(cfg)}", file=sys.stderr)
    if not worker and (world > 1 or args.max_restarts):
        config = os.path.join(run_dir, "config.toml")
        if cfg.parallel.islands > 1 and cfg.training.outer.on_island_loss == "continue":  # docs/diloco.md
            from .train.island_jobs import spawn_islands
            code = spawn_islands(world, cfg.parallel.islands, config, run_dir, args.max_restarts, cfg.parallel.timeout_s)
        else:
            code = spawn(world, config, run_dir, args.max_restarts)
        for line in incidents(run_dir):  # stragglers, spikes, restarts: what the job lived through
            print(line, file=sys.stderr)
        if code and len(preempted(run_dir)) == world:  # saved on checkpoint.on_signal: spawn said so
            return code
        if code:
            for line in worker_errors(run_dir):  # the failing ranks' own one-line reasons
                print(line, file=sys.stderr)
        if not code:
            _print_sample(cfg, run_dir)
        return code and _fail(f"training failed (exit {code}); worker logs in {run_dir}/logs", code)
    from .train.worker import run_worker
    if start.auto_record and int(os.environ.get("RANK", "0")) == 0:  # the planner's choice, said once
        from .plan.search.auto import log_choice
        log_choice(start.auto_record, run_dir)
    try:
        last = run_worker(cfg, run_dir, restarts, start.layout)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        prefix = f"rank {os.environ.get('RANK', '0')}: "
        line = first if first.startswith(prefix) else prefix + first  # CollectiveErrors name the rank
        if worker:
            record_error(run_dir, int(os.environ.get("RANK", "0")), f"meshlm: {line}")
        return _fail(line, 1)
    if "preempted" in last:  # saved and stopped on checkpoint.on_signal; rank 0 said so (train/resilience/preempt.py)
        from .train.resilience.preempt import (
            exit_status,  # meshlm's launcher gives the status (its torchrun would restart)
        )
        return 0 if args.worker else exit_status(last["preempted"]["signal"])
    if last and int(os.environ.get("RANK", "0")) == 0 and os.environ.get("MESHLM_ISLAND", "0") == "0":  # island jobs: island 0
        print(f"meshlm: done, step {last.get('step')} loss {last.get('loss', float('nan')):.4f}; "
              f"run dir {run_dir}", file=sys.stderr)
        if not worker:
            _print_sample(cfg, run_dir)
    return 0


SAMPLE_PROMPT = "def "
SAMPLE_MAX_PARAMS = 50e6  # a greedy line from a model this small takes a second on a CPU


def _print_sample(cfg, run_dir: str) -> None:
    """A small model's greedy continuation of "def " from the newest checkpoint, so the user sees what
    it learnt without asking (README, quick start); larger models and runs without a checkpoint: none."""
    from .core.config.model import model_args
    from .train.checkpoint import list_checkpoints
    if model_args(cfg).num_params() > SAMPLE_MAX_PARAMS or not list_checkpoints(os.path.join(run_dir, "checkpoints")):
        return
    from .generate import continuation
    try:
        text = continuation(run_dir, SAMPLE_PROMPT, 60, temperature=0.0).split("\n\n")[0]
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # the run itself succeeded: say so, go on
        print(f"meshlm: no sample: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return
    print(f"meshlm: sample (greedy, `meshlm generate {run_dir} --prompt {SAMPLE_PROMPT!r} --temperature 0`):\n"
          f"{SAMPLE_PROMPT}{text}", file=sys.stderr)


def cmd_prepare(args, extra: list[str]) -> int:
    import signal

    from .data import prepare
    if extra:
        return _fail(f"unrecognised argument: {extra[0]}")
    # SIGTERM (a scheduler's kill) unwinds like Ctrl-C, so the temp output is removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        index = prepare(args.input, args.tokenizer, args.out, val_fraction=args.val_fraction,
                        text_field=args.text_field, workers=args.workers, eos=args.eos,
                        progress=sys.stderr.isatty())
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e).splitlines()[0])
    except KeyboardInterrupt:
        return _fail(f"prepare interrupted; nothing written to {args.out}", 130)
    n = {k: v["tokens"] for k, v in index["splits"].items()}
    print(f"meshlm: prepared {index['documents']} documents, {n} tokens ({index['dtype']}, "
          f"vocab {index['vocab_size']}) into {args.out}")
    return 0


def cmd_report(args, extra: list[str]) -> int:
    from .train.observe.report import write_report
    if extra:
        return _fail(f"unrecognised argument: {extra[0]}")
    try:
        out = write_report(args.run_dir, args.out)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    print(f"meshlm: wrote {out}")
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand; with `command`, the modules after the one that adds it are left out (`meshlm
    plan` need not import torch, which the explorer's and the converter's modules do: 1.7 s of its start)."""
    p = argparse.ArgumentParser(prog="meshlm", description="Train LLMs on one device mesh.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model (extra --section.key VALUE pairs override the config)")
    t.add_argument("--config", help="TOML config file")
    t.add_argument("--nproc", type=int, help="start N local workers through torchrun")
    t.add_argument("--run-dir", help="where config, metrics, checkpoints and logs go")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="restart all workers up to R times after one fails, resuming from the newest "
                        "checkpoint (torchrun's elastic agent; also with one worker)")
    t.add_argument("--link-server", type=int, metavar="PORT",
                   help="host the island link of island jobs that other schedulers start (training.outer."
                        "on_island_loss = continue; docs/diloco.md): start no worker")
    t.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    t.set_defaults(func=cmd_train)
    pr = sub.add_parser("prepare", help="tokenise a corpus (text, JSON Lines, Parquet, save_to_disk) into "
                                        "memory-mapped shards")
    pr.add_argument("--input", nargs="+", required=True, help="files or directories (docs/data.md)")
    pr.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json")
    pr.add_argument("--out", required=True)
    pr.add_argument("--val-fraction", type=float, default=0.01)
    pr.add_argument("--text-field", default="text", help="JSON Lines / Parquet / datasets column (default text)")
    pr.add_argument("--workers", type=int, default=None, help="tokenising processes (default: all cores)")
    pr.add_argument("--eos", default=None, help="end-of-document token (default: tokenizer_config.json's)")
    pr.set_defaults(func=cmd_prepare)
    r = sub.add_parser("report", help="draw a run's loss, throughput and memory curves to a PNG")
    r.add_argument("run_dir")
    r.add_argument("--out", help="PNG path (default RUN_DIR/report.png)")
    r.set_defaults(func=cmd_report)
    for mod, fn in (("meshlm.plan.cli", "add_parsers"), ("meshlm.core.schedule.command", "add_parser"),
                    ("meshlm.explore.server", "add_parser"), ("meshlm.cli_hf", "add_parsers")):
        if command is not None and command in sub.choices:
            break
        try:
            module = __import__(mod, fromlist=[fn])
        except ImportError as e:
            if (e.name or "").split(".")[0] != "torch":  # a broken command module is an error, not a gap
                raise
            continue  # an install without torch keeps the commands that need none (plan, estimate)
        getattr(module, fn)(sub)
    return p


def _attention(cfg, layout, asked: str) -> str:
    """The start-up line's attention kernel where a mask makes the choice matter (a document mask, or
    all-gather CP's zig-zag rows), and why when "auto" chose it (docs/benchmarks.md, "Attention kernels
    by device")."""
    from .core.config.model import attn_kernel
    masked = cfg.data.document_mask or (layout.cp_enabled and cfg.parallel.cp_impl == "allgather")
    if not masked:
        return ""
    kernel = attn_kernel(cfg)
    if asked != "auto":
        return f", attention {kernel}"
    why = "SDPA with the mask on a CPU, where flex fuses only its forward" if cfg.model.attn_impl == "sdpa" \
        else "flex on CUDA, measured faster than SDPA's dense mask"
    return f", attention {kernel} (auto: {why})"


def _fp8_comm(cfg, layout) -> str:
    """The start-up line under fp8: which float8 code runs (production or emulated, model/fp8_kernels.py), the
    training.fp8_comm entries this layout uses, and those it asked for that do not apply (no ZeRO-3 shard
    group, no SP, ep = 1, the rowwise recipe): they are left out, not refused (docs/fp8.md)."""
    import torch

    from .core.layout import fp8_comm_in_use, model_args
    from .model.fp8_kernels import fp8_path
    t = cfg.training
    if t.precision != "fp8":
        return ""
    device = "cuda" if t.device != "cpu" and torch.cuda.is_available() else "cpu"
    used = fp8_comm_in_use(t.precision, t.fp8_recipe, t.fp8_comm, layout)
    unused = [e for e in t.fp8_comm if e not in used]
    return (f" ({fp8_path(device, t.fp8_recipe, t.fp8_emulate, bool(model_args(cfg).moe))}; "
            f"float8 collectives: {', '.join(e for e in t.fp8_comm if e in used) or 'none'}"
            + (f"; not applying here: {', '.join(unused)}" if unused else "") + ")")


def _islands(cfg, layout) -> str:
    """The start-up line's DiLoCo islands (docs/diloco.md): the metrics line then speaks for island 0."""
    if layout.islands <= 1:
        return ""
    o = cfg.training.outer
    return (f" in {layout.islands} DiLoCo islands (outer sync every {o.sync_every} steps, {o.fragments} "
            f"fragment{'s' if o.fragments > 1 else ''}, outer gradients {'fp32' if o.quantize == 'none' else o.quantize}; "
            f"losses logged are island 0's)")


def _shared_gpus(cfg, world: int) -> str:
    """The start-up line's note when this node's workers outnumber its GPUs (mesh.ranks_share_gpus)."""
    import torch
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    n = torch.cuda.device_count() if cfg.training.device != "cpu" and torch.cuda.is_available() else 0
    return f" sharing {n} GPU{'s' if n > 1 else ''} (gloo through host memory: for checks, not speed)" \
        if 0 < n < local else ""


def _energy(cfg) -> str:
    """The start-up line's energy counters, or why there are none, said once (docs/energy.md, "Measured
    energy"); each worker opens its own (train/observe/energy.py)."""
    import torch

    from .train.observe.energy import open_counters
    return open_counters("cuda" if cfg.training.device != "cpu" and torch.cuda.is_available() else "cpu")[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args, extra = parser.parse_known_args(argv)
    return args.func(args, extra) if _takes_extra(args.func) else args.func(args)


def _takes_extra(fn) -> bool:
    return fn.__code__.co_argcount >= 2


def run() -> None:
    """The `meshlm` command (and `python -m meshlm.cli`, which every worker is): `main` in a process that
    ends when it returns, through core/process.py `exit_frozen`."""
    from .core.process import exit_frozen
    exit_frozen(main())


if __name__ == "__main__":
    run()
