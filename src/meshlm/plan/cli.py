"""`meshlm estimate` and `meshlm plan`: argparse wiring, tables and JSON.

Both read the same config file and `--section.key value` overrides as `meshlm train`, so a training
config can be estimated as it is. Bad input prints one line on stderr and returns 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..core import config as C
from ..core.layout import check_rampup
from .cost import energy as en, islands as isl
from .cost.estimate import CATEGORIES, Options, describe_run, estimate, run_time, step_categories
from .cost.energy_schedule import schedule_lines
from .cost.goodput import Resilience, describe as describe_goodput, goodput
from .hardware import FLAG_FIELDS, GIB, HardwareError, describe, get_gpu, names
from .cost.ops import KERNELS
from .search.ranked import PlanError, parse_fix, plan
from .search import objective as obj
from . import energy_cli as ecli
from .mixed.cli import cluster_of, estimate_mixed, format_estimate_mixed, run_plan_mixed
from ..core.choices import OPTIMIZERS
from .spec import (Shape, code_options, presets, priced_on, search_knobs, shape_from_config,
                   spec_from_config, spec_of_layout, to_config)


def _fail(msg: str, code: int = 2) -> int:
    print(f"meshlm: {msg}", file=sys.stderr)
    return code


def _hardware_flags(p: argparse.ArgumentParser, gpu_required: bool) -> None:
    p.add_argument("--gpu", help=f"GPU profile: {', '.join(names())}" + (" (or --calibrate)" if gpu_required else "")
                   + "; a mixed cluster as TYPE:COUNT[/NODE],... in rank order, e.g. h100:8,a100-80gb:8 "
                     "(docs/heterogeneous.md)")
    p.add_argument("--gpus", type=int, default=None,
                   help="number of GPUs (world size; default 1 for estimate; a mixed --gpu gives it)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node sharing NVLink (default: the profile's, 8)")
    g = p.add_argument_group("custom hardware (override or define a profile)")
    g.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per GPU")
    g.add_argument("--hbm-gb", type=float, help="GPU memory, GB")
    g.add_argument("--hbm-tbps", type=float, help="GPU memory bandwidth, TB/s")
    g.add_argument("--nvlink-gbps", type=float, help="intra-node bandwidth per GPU per direction, GB/s")
    g.add_argument("--ib-gbps", type=float, help="inter-node bandwidth per GPU per direction, GB/s")
    g.add_argument("--pcie-gbps", type=float, help="host link per GPU, GB/s (optimizer offload)")
    g.add_argument("--cpu-adam-gparams", type=float,
                   help="host AdamW throughput per GPU, G params/s (optimizer offload; default 2)")
    g.add_argument("--disk-read-gbps", type=float,
                   help="sequential disk read per GPU's share of the node's drives, GB/s (nvme offload; default 6.5)")
    g.add_argument("--disk-write-gbps", type=float,
                   help="sequential disk write per GPU's share, GB/s (nvme offload; default 3.5)")
    g.add_argument("--overlap-slowdown", type=float,
                   help="fraction by which compute beside an overlapped collective slows (default 0.197, measured: "
                        "bench/overlap.py)")
    m = p.add_argument_group("model assumptions (docs/planner.md)")
    m.add_argument("--efficiency", type=float, default=None,
                   help="price all model math at this fraction of peak instead of the per-operation model")
    m.add_argument("--attn-kernel", default=Options.attn_kernel, choices=KERNELS,
                   help="attention kernel of the per-operation model (default %(default)s)")
    m.add_argument("--comm-efficiency", type=float, default=Options.comm_efficiency,
                   help="achieved fraction of link bandwidth (default %(default)s)")
    m.add_argument("--no-flash", action="store_true",
                   help="attention without a fused kernel: the S×S scores are saved for backward")
    m.add_argument("--calibrate", metavar="RUN_DIR",
                   help="price compute and links with the rate and bandwidth fitted from a finished meshlm run "
                        "(plan/calibrate/fit.py; replaces --gpu)")
    m.add_argument("--json", action="store_true", help="print JSON instead of a table")


# `meshlm plan`'s failure and checkpoint model (plan/cost/goodput.py): flag, default, help
FAILURE_FLAGS = (
    ("--failures-per-gpu-hour", Resilience.failures_per_gpu_hour,
     "per-GPU failure rate (default: Llama 3's, 419 in 54 days on 16,384 GPUs)"),
    ("--ckpt-node-gbps", Resilience.node_write_gbps, "GB/s one node writes a checkpoint at (default %(default)s)"),
    ("--storage-gbps", Resilience.storage_gbps, "GB/s the shared file system sustains (default %(default)s)"),
    ("--restart-min", Resilience.restart_min, "minutes to detect a failure, restart and reload (default %(default)s)"),
    ("--spare-min", Resilience.spare_min,
     "minutes until a replacement node is up; else resize (default %(default)s: hot spare)"),
    ("--repair-h", Resilience.repair_h, "hours until a lost node is back, when the job resizes (default %(default)s)"),
)


def add_parsers(subparsers) -> None:
    e = subparsers.add_parser("estimate", help="memory, time and MFU of one layout (takes --section.key overrides)")
    e.add_argument("--config", help="TOML config file, as for `meshlm train`")
    _hardware_flags(e, gpu_required=False)
    isl.add_flags(e)
    en.add_flags(e, prices=True)
    e.set_defaults(func=run_estimate)
    p = subparsers.add_parser("plan", help="search every layout of N GPUs and rank those that fit")
    p.add_argument("--model", help=f"preset ({', '.join(presets())}); default: --config's model")
    p.add_argument("--config", help="TOML config whose model section (and data.seq_len, global batch) to use")
    _hardware_flags(p, gpu_required=True)
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: config data.seq_len, else the model's pretraining context: max_seq_len, or rope_scaling's original_max_position_embeddings)")
    p.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step (default 4Mi)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32", "fp8"))
    p.add_argument("--optim", choices=OPTIMIZERS,
                   help="optim.name the layouts are priced for (default: the config's, else adamw); muon never "
                        "offloads the optimizer")
    p.add_argument("--top", type=int, default=10, help="how many layouts to print (default %(default)s)")
    p.add_argument("--explain", action="store_true", help="also say why the other layouts were discarded")
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE",
                   help="pin a dimension, e.g. --fix tp=8 --fix zero=3 (repeatable)")
    p.add_argument("--emit-config", metavar="FILE", help="write the best layout as a meshlm train config")
    p.add_argument("--emit-rank", type=int, default=1, metavar="N",
                   help="with --emit-config: write the N-th ranked layout instead (default 1, the best; "
                        "`meshlm explore`'s row N)")
    f = p.add_argument_group("failures and checkpoints (plan/cost/goodput.py)")
    for flag, default, help_ in FAILURE_FLAGS:
        f.add_argument(flag, type=float, default=default, help=help_)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="plan for training.compile = true / false (compiled blocks save fewer activations); "
                        "default: the config's, whose \"auto\" compiles on a GPU, not for a CPU run's --calibrate")
    isl.add_flags(p)
    p.add_argument("--objective", default="time", help="rank by time (step seconds), energy (J/token) or pareto "
                   "(the time-energy front); default %(default)s")
    p.add_argument("--max-slowdown", type=float, default=None,
                   help="the clock plan's bound on a pipeline's slowdown (default 0.01 under --objective energy / pareto)")
    en.add_flags(p, prices=False)
    p.set_defaults(func=run_plan)


def _options(args, cfg) -> Options:
    if (args.efficiency is not None and not 0 < args.efficiency <= 1) or not 0 < args.comm_efficiency <= 1:
        raise PlanError("--efficiency / --comm-efficiency: must be in (0, 1]")
    return Options(efficiency=args.efficiency, comm_efficiency=args.comm_efficiency, flash=not args.no_flash,
                   attn_kernel=args.attn_kernel, **code_options(cfg))


def _gpu(args):
    flags = {k: getattr(args, k, None) for k in FLAG_FIELDS}
    return get_gpu(args.gpu, **flags)


def _device(args, cfg, ranks: int):
    """(the config priced on the device, GPU profile, Options, Calibration or None): the named profile
    (none: memory per GPU), or with --calibrate the machine a run measured, a GPU or a CPU."""
    if getattr(args, "calibrate", None):
        from .calibrate.fit import device_and_options, fit
        if args.gpu:
            raise PlanError("--calibrate: leave out --gpu (the run's machine is the device)")
        cal = fit(args.calibrate)
        cfg = priced_on(cfg, gpu=cal.card is not None)
        gpu, o = device_and_options(cal, ranks, bool(cfg.training.compile))
        return cfg, gpu, dataclasses.replace(o, **code_options(cfg)), cal
    cfg = priced_on(cfg, gpu=True)
    return cfg, _gpu(args), _options(args, cfg), None


# ---------------------------------------------------------------------------------- estimate

def run_estimate(args, extra_argv: list[str] | None = None) -> int:
    try:
        pairs, rest = C.parse_overrides(list(extra_argv or []))
        if rest:
            raise PlanError(f"unrecognised argument: {rest[0]}")
        cfg = C.load(args.config, pairs)
        cluster = cluster_of(args, cfg)
        if cluster is not None:
            isl.refuse_mixed(args, cfg)
            return _estimate_mixed(args, cfg, cluster)
        args.gpus = 1 if args.gpus is None else args.gpus
        cfg, gpu, opts, cal = _device(args, cfg, args.gpus)
        islands = isl.islands_flag(args, cfg)
        shape = shape_from_config(cfg)
        spec = spec_from_config(cfg, args.gpus)
        check_rampup(cfg, spec)
        site = en.site_of(args)
        out = estimate(shape, spec, gpu, opts)
        when = schedule_lines(cfg, out, shape, spec, gpu, opts)  # training.energy.trace (docs/energy.md)
        if islands > 1:  # DiLoCo: the cross-island traffic and step times (plan/cost/islands.py)
            out["islands"] = isl.report(out, islands, cfg.training.outer, args.link_gbps, args.link_latency_ms)
    except (C.ConfigError, PlanError, HardwareError) as e:
        return _fail(str(e))
    run = None
    if "step_s" in out:  # the run's total time, the ramp's smaller steps priced at their batch
        run = run_time(shape, spec, gpu, opts, cfg.training.steps, cfg.training.batch_rampup, out["step_s"])
        if run["ramp_steps"]:  # (--json as the explorer's estimate without one: explore/api.py)
            out["run"] = run
        try:  # J/step, J/token, the run's kWh (plan/energy_cli.py)
            ecli.estimate_energy(args, out, gpu, cal, site, run["seconds"])
        except PlanError as e:
            return _fail(str(e))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        sources = None
        if cal is not None:
            from .calibrate.fit import rate_sources
            sources = rate_sources(cal, args.gpus)
        text = format_estimate(out, gpu, sources)
        if "islands" in out:
            text += "\n" + isl.describe(out["islands"])
        print(text + ("\n" + describe_run(run) if run else "")
              + ("\n" + en.describe(out["energy"]) if "energy" in out else "") + "".join("\n" + line for line in when))
    return 0


def _estimate_mixed(args, cfg, cluster) -> int:
    """`meshlm estimate` on a mixed cluster (plan/mixed/cli.py)."""
    cfg = priced_on(cfg, gpu=True)
    out = estimate_mixed(shape_from_config(cfg), cfg, cluster, _options(args, cfg))
    print(json.dumps(out, indent=1) if args.json else format_estimate_mixed(out, cluster))
    return 0


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GIB:.2f} GiB"


def format_estimate(r: dict, gpu=None, sources: tuple[str, dict] | None = None) -> str:
    """The estimate as text; `sources` (calibrate.rate_sources): which rates a --calibrate run gave."""
    L, pg, d = r["layout"], r["per_gpu"], r["memory_detail"]
    lines = [f"model {r['model']}: {r['params'] / 1e9:.3f}B parameters, {r['gpus']} GPUs"
             + (f" ({describe(gpu)})" if gpu is not None and gpu.peak_flops else ""),
             "layout: " + ", ".join(f"{k}={v}" for k, v in L.items()),
             (f"memory per GPU, worst rank ({d['stage']} stage, {d['layers']} layers, "
              f"{d['inflight_microbatches']:g} micro-batches in flight, flash={r['flash']}, "
              f"compiled={r['compiled']}, attention mask={r['attn_mask']}):")]
    for k in ("params", "grads", "optim", "activations", "buffers", "total"):
        lines.append(f"  {k:<12}{_gib(pg[k]):>14}")
    if pg["cpu_optim"]:
        where = "streaming buffer in host memory" if L["offload"] == "nvme" else "offloaded to host memory"
        lines.append(f"  {'cpu optim':<12}{_gib(pg['cpu_optim']):>14}  ({where})")
    if pg["disk_optim"]:
        lines.append(f"  {'disk optim':<12}{_gib(pg['disk_optim']):>14}  (fp32 master, m, v in offload_dir files)")
    lines.append("  buffers: " + ", ".join(f"{k} {_gib(v)}" for k, v in d["buffers"].items()))
    if r["fits"] is None:
        lines.append("fits: unknown (give --gpu or --hbm-gb)")
    else:
        lines.append(f"fits: {'yes' if r['fits'] else 'NO'} ({_gib(pg['total'])} of {_gib(r['usable_bytes'])} usable)")
    if "step_s" in r:
        t = r["time"]
        lines.append(f"step {r['step_s']:.3f} s, {r['tokens_per_s_per_gpu']:.1f} tokens/s per GPU, MFU {r['mfu']:.1%}")
        lines.append(f"  forward {t['forward_s']:.3f} s, backward {t['backward_s']:.3f} s, recompute "
                     f"{t['recompute_s']:.3f} s, exposed comm {t['exposed_comm_microbatch_s'] + t['exposed_comm_step_s']:.3f} s, "
                     f"bubble {t['bubble_s']:.3f} s ({t['bubble_fraction']:.1%}, {t['bubble_source']}), "
                     f"optimizer {t['optimizer_s'] + t['offload_s']:.3f} s"
                     + (f" (disk I/O {t['offload_io_s']:.3f} s)" if t["offload_io_s"] else "")
                     + (f", compute beside comm +{t['overlap_slowdown_s']:.3f} s (overlap_slowdown "
                        f"{gpu.overlap_slowdown:g})" if gpu is not None else ""))
        lines += _categories(r, sources)
        if r["comm"]:
            lines.append(f"  {'group':<13}{'kind':<16}{'link':<7}{'n':>6}{'GB/step':>10}{'time s':>9}{'exposed':>9}  overlaps")
            for c in r["comm"]:
                lines.append(f"  {c['group']:<13}{c['kind']:<16}{c['link']:<7}{c['group_size']:>6}"
                             f"{c['bytes'] / 1e9:>10.2f}{c['seconds']:>9.3f}{c['exposed_s']:>9.3f}  {c['overlaps_with']}")
    return "\n".join(lines)


def _categories(r: dict, sources: tuple[str, dict] | None) -> list[str]:
    """The step's seconds by category (estimate.step_categories, as --json's `ops` and `time`), each
    with the rate a --calibrate run fitted for it."""
    cats = step_categories(r)
    notes = sources[1] if sources else {}
    lines = (["  " + sources[0]] if sources else []) + \
        ["  seconds per step by category" + (" (rate: from the calibration run)" if sources else "") + ":"]
    for k, v in cats.items():
        note = notes.get(k, "the model's own (not fitted)" if sources else "")
        lines.append(f"    {CATEGORIES[k]:<24}{v:>10.4f} s {v / r['step_s'] if r['step_s'] else 0:>6.1%}"
                     + (f"  {note}" if note else ""))
    lines.append(f"    {'step':<24}{sum(cats.values()):>10.4f} s")
    return lines


# ---------------------------------------------------------------------------------- plan

def _plan_inputs(args, extra_argv: list[str] | None):
    """(config, shape, seq, tokens per step) of `meshlm plan`'s flags, or a PlanError naming the flag."""
    if extra_argv:
        raise PlanError(f"unrecognised argument: {extra_argv[0]}")
    cfg = C.load(args.config) if args.config else C.Config()
    if args.compile is not None:
        cfg.training.compile = args.compile
    if args.optim:
        cfg.optim.name = args.optim
    if args.model:
        cfg.model.preset = args.model
    elif not args.config:
        raise PlanError("--model: give a preset (or --config with a model section)")
    shape = shape_from_config(cfg)
    seq = args.seq_len or (cfg.data.seq_len if args.config else shape.args.pretrain_seq_len)
    tokens = args.global_batch_tokens or (cfg.training.global_batch * seq if args.config else 2 ** 22)
    if args.top < 1:
        raise PlanError(f"--top: must be >= 1, got {args.top}")
    if not 1 <= args.emit_rank <= args.top:
        raise PlanError(f"--emit-rank: must be 1 to --top = {args.top}, got {args.emit_rank}")
    if not args.gpu and not args.calibrate:
        raise PlanError("--gpu: give a GPU profile (or --calibrate RUN_DIR)")
    return cfg, shape, seq, tokens


def run_plan(args, extra_argv: list[str] | None = None) -> int:
    try:
        cfg, shape, seq, tokens = _plan_inputs(args, extra_argv)
        site = ecli.plan_site(args)
        cluster = cluster_of(args)
        if cluster is not None:  # more than one device type (plan/mixed/search.py)
            if args.objective != "time":
                raise PlanError("--objective: a mixed cluster is ranked by time only")
            isl.refuse_mixed(args, cfg)
            cfg = priced_on(cfg, gpu=True)
            return run_plan_mixed(args, cfg, shape, cluster, seq, tokens, _options(args, cfg), parse_fix(args.fix),
                                  search_knobs(cfg))
        if args.gpus is None:
            raise PlanError("--gpus: give the number of GPUs (or a mixed cluster: --gpu TYPE:COUNT,...)")
        cfg, gpu, opts, cal = _device(args, cfg, args.gpus)  # --emit-config: compile as priced
        islands = isl.islands_flag(args, cfg)  # DiLoCo: the search is one island's (plan/cost/islands.py)
        power = ecli.plan_power(args, gpu, cal)
        res = plan(shape, gpu, args.gpus // islands, seq, tokens // islands, args.precision, args.top,
                   parse_fix(args.fix), opts, optim=cfg.optim.name, knobs=search_knobs(cfg),
                   keep=obj.keep_for(args.objective, args.top), order=obj.ordering(args.objective, power, gpu, site))
        clocks = ecli.after_search(res, args, shape, gpu, opts, power, site)
        rates = (args.failures_per_gpu_hour, args.ckpt_node_gbps, args.storage_gbps, args.restart_min,
                 args.spare_min, args.repair_h)
        if min(rates) < 0 or min(rates[1:3]) <= 0:
            raise PlanError("--failures-per-gpu-hour / --restart-min / --spare-min / --repair-h must be >= 0, "
                            "--ckpt-node-gbps / --storage-gbps > 0")
        good = goodput(shape.num_params(), args.gpus, gpu.gpus_per_node, Resilience(*rates))
    except (C.ConfigError, PlanError, HardwareError) as e:
        return _fail(str(e))
    except OSError as e:  # --emit-config of a mixed plan
        return _fail(f"--emit-config: cannot write {args.emit_config}: {e.strerror}")
    for r in res.ranked:  # the same for every layout: each rank writes its shard of the full state
        r["resilience"] = good
        r["goodput_tokens_per_s_per_gpu"] = r["tokens_per_s_per_gpu"] * good["goodput"]
    if args.json:
        print(json.dumps(res.ranked, indent=1))
    else:
        print(format_plan(res, shape, gpu, args.gpus // islands, seq, tokens // islands, cfg.optim.name,
                          args.objective))
        if clocks is not None:
            print(ecli.clock_line(clocks, res.ranked[min(args.emit_rank, len(res.ranked)) - 1]))
        print(describe_goodput(good))
        if islands > 1 and res.ranked:
            print(isl.describe(isl.report(res.ranked[0], islands, cfg.training.outer, args.link_gbps,
                                          args.link_latency_ms)))
    if args.explain:
        print(format_explain(res), file=sys.stderr if args.json else sys.stdout)
    if not res.ranked:
        return _fail("no layout fits; see --explain", 1)
    if args.emit_config:
        if args.emit_rank > len(res.ranked):
            return _fail(f"--emit-rank: only {len(res.ranked)} layouts fit, no row {args.emit_rank}", 1)
        best = spec_of_layout(res.ranked[args.emit_rank - 1]["layout"])
        out = to_config(shape, best, cfg)
        out.training.global_batch *= islands  # the layout is one island's, the batch the job's (parallel.islands kept)
        try:
            text = ecli.emitted_toml(out, clocks)
            with open(args.emit_config, "w") as f:
                f.write(text)
        except OSError as e:
            return _fail(f"--emit-config: cannot write {args.emit_config}: {e.strerror}")
        if not args.json:
            print(f"wrote {args.emit_config}")
    return 0


def format_plan(res, shape: Shape, gpu, n: int, seq: int, tokens: int, optim: str = "adamw",
                objective: str = "time") -> str:
    c = res.counts
    head = (f"{shape.name}: {shape.num_params() / 1e9:.2f}B params on {n} × {gpu.name} "
            f"({gpu.gpus_per_node}/node), seq {seq}, {tokens:,} tokens/step = {res.global_batch} sequences"
            f"{'' if optim == 'adamw' else ', optimizer ' + optim}\n"
            f"searched {c['candidates']:,} layouts in {res.elapsed_s:.2f} s"
            f"{f' ({res.processes} processes)' if res.processes > 1 else ''}: {c['fit']:,} fit, "
            f"{c['oom']:,} out of memory, {c['invalid']:,} invalid; {c['dominated']:,} dominated by a faster "
            f"AC/offload variant")
    ep = shape.moe  # expert parallelism is a degree of MoE models only
    cols = f"{'#':>3} {'tok/s/GPU':>10} {'MFU':>6} {'step s':>8} {'GiB':>6}  {'tp':>3} {'sp':>2} {'pp':>3} " \
           f"{'schedule':<13} {'cp':>3} {'dp':>5}{' ' + format('ep', '>4') if ep else ''} {'zero':<8} {'mb×m':>8} " \
           f"{'ac':<9} offload"
    energy = objective != "time"  # a J/token column (plan/search/objective.py)
    if energy:
        head += "\n" + obj.describe(objective, res.counts["ranked_in_detail"])
        cols += f"{'':2} {'J/token':>8}"
    rows = [head, cols]
    for i, r in enumerate(res.ranked, 1):
        L = r["layout"]
        sched = "-" if L["pp"] == 1 else L["pp_schedule"] + (f" v{L['pp_virtual']}" if L["pp_virtual"] > 1 else "")
        zero = f"{L['zero']}" + (f" g{L['zero_group']}" if L["zero"] and L["zero_group"] != L["dp"] else "")
        rows.append(f"{i:>3} {r['tokens_per_s_per_gpu']:>10.1f} {r['mfu']:>6.1%} {r['step_s']:>8.2f} "
                    f"{r['per_gpu']['total'] / GIB:>6.1f}  {L['tp']:>3} {('y' if L['sp'] else '-'):>2} {L['pp']:>3} "
                    f"{sched:<13} {L['cp']:>3} {L['dp']:>5}{' ' + format(L['ep'], '>4') if ep else ''} {zero:<8} "
                    f"{str(L['micro_batch']) + '×' + str(L['microbatches']):>8} "
                    f"{L['ac']:<9} " + (f"{L['offload']:<9} {r['j_per_token']:>8.4f}" if energy else L["offload"]))
    if not res.ranked:
        rows.append("  (no layout fits)")
    return "\n".join(rows)


def format_explain(res) -> str:
    lines = ["discarded:"]
    for reason, n in res.reasons.most_common():
        ex = res.examples.get(reason)
        lines.append(f"  {n:>9,}  {reason}" + (f"\n             e.g. {ex}" if ex else ""))
    if len(lines) == 1:
        lines.append("  nothing")
    return "\n".join(lines)
