"""`meshlm plan` and `meshlm estimate` on a mixed cluster (`--gpu h100:8,a100-80gb:8`, or a config's
parallel.devices): the cluster from the flags, the tables and JSON. plan/cli.py hands over here when the
cluster has more than one device type; a single type (`--gpu h100:16`) goes the one-type way unchanged.
"""
from __future__ import annotations

import dataclasses
import json
import sys

from ...core import config as C
from ..cluster import Cluster, check_world, is_mixed_flag, parse_cluster, tp_span
from ..hardware import FLAG_FIELDS, GIB, HardwareError
from .search import MixedPlan, plan_mixed
from .price import Priced, price_data, price_pipeline, weights_of
from ..spec import PlanError, Shape, spec_from_config, to_config


def cluster_of(args, cfg=None) -> Cluster | None:
    """The cluster `--gpu TYPE:COUNT,...` names (or, for estimate, the config's parallel.devices), checked
    against --gpus when that is given; None for one profile name. A one-type list (`--gpu h100:16/8`)
    becomes that name, --gpus and --gpus-per-node on `args`, so it runs exactly as the one-type flags."""
    flags = {k: getattr(args, k, None) for k in FLAG_FIELDS}
    devices = list(cfg.parallel.devices) if cfg is not None and cfg.parallel.devices else []
    if is_mixed_flag(args.gpu):
        cluster = parse_cluster(args.gpu.split(","), **flags)
        if devices and parse_cluster(devices, "parallel.devices", **flags) != cluster:
            raise HardwareError(f"parallel.devices: {','.join(devices)} is not the --gpu cluster {args.gpu}")
    elif devices and not args.gpu:
        cluster = parse_cluster(devices, "parallel.devices", **flags)
    else:
        return None
    check_world(cluster, getattr(args, "gpus", None), "--gpus")
    if getattr(args, "calibrate", None):
        raise PlanError("--calibrate: a mixed cluster is priced from the device profiles (leave out --calibrate)")
    if cluster.mixed:
        return cluster
    g = cluster.groups[0]
    args.gpu, args.gpus, args.gpus_per_node = g.card, cluster.world, g.gpu.gpus_per_node
    return None


def _weights(p: Priced) -> list[int]:
    return weights_of(list(p.spec.dp_accums)) if p.spec.dp_accums else []


def row(p: Priced, shape: Shape, cluster: Cluster) -> dict:
    """One mixed layout as `--json` prints it: the layout keys that train it, the step, the per-type facts."""
    s, world = p.spec, cluster.world
    tokens = s.global_batch * s.seq_len
    peak = sum(g.count * g.gpu.peak(s.precision) for g in cluster.groups)
    layout = dict(s.layout_dict(), devices=cluster.items(), dp_weights=_weights(p))
    return {"spans": p.spans, "layout": layout, "step_s": p.step_s, "tokens_per_s": tokens / p.step_s,
            "tokens_per_s_per_gpu": tokens / p.step_s / world,
            "mfu": shape.flops_per_token(s.seq_len) * tokens / (p.step_s * peak), "bubble_source": p.source,
            "fits": p.fits, "per_type": p.per_type,
            "per_gpu": {"total": max(t["bytes"] for t in p.per_type)}, "gpus": world}


def comparison(res: MixedPlan) -> dict:
    """The best mixed layout against the fastest type alone: the gain in tokens/s (same global batch)."""
    best = res.ranked[0] if res.ranked else None
    alone = res.alone
    gain = None if best is None or alone is None else alone["step_s"] / best.step_s - 1
    return {"alone_gpus": res.alone_group.count, "alone_gpu": res.alone_group.gpu.name,
            "alone_step_s": alone["step_s"] if alone else None, "alone_layout": alone["layout"] if alone else None,
            "mixed_step_s": best.step_s if best else None, "gain": gain,
            "pays": best is not None and (alone is None or best.step_s < alone["step_s"])}


def _split_text(p: Priced) -> str:
    if p.spans == "pp":
        return "pp_layers " + "/".join(map(str, p.spec.pp_layers))
    w = _weights(p)
    runs: list[list[int]] = []
    for x in w:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return "dp_weights " + ", ".join(f"{x} (×{n})" for x, n in runs)


def _per_type_lines(p: Priced) -> list[str]:
    out = []
    for t in p.per_type:
        what = (f"{t['units']} stage{'s' if t['units'] > 1 else ''}, {'+'.join(map(str, t['layers']))} blocks"
                if p.spans == "pp" else f"{t['units']} replicas, {t['sequences'][0]} sequences each")
        out.append(f"  {t['gpu']:<16}{t['gpus']:>4} GPUs ({what}): {t['bytes'] / GIB:.1f} GiB of "
                   f"{t['usable'] / GIB:.1f} usable, compute {t['busy_s']:.2f} s of the {p.step_s:.2f} s step")
    return out


def format_mixed(res: MixedPlan, shape: Shape, optim: str = "adamw") -> str:
    c, cl = res.counts, res.cluster
    tokens = res.global_batch * res.seq_len
    lines = [f"{shape.name}: {shape.num_params() / 1e9:.2f}B params on {cl.world} GPUs: {cl.describe()}, seq "
             f"{res.seq_len}, {tokens:,} tokens/step = {res.global_batch} sequences"
             f"{'' if optim == 'adamw' else ', optimizer ' + optim}",
             f"searched {c['candidates'] + c['bounded']:,} mixed layouts in {res.elapsed_s:.2f} s: {c['fit']:,} fit, "
             f"{c['oom']:,} out of memory, {c['invalid']:,} invalid; {c['bounded']:,} ruled out by their compute alone",
             f"  {'#':>2} {'tok/s/GPU':>10} {'step s':>8} {'spans':<6}{'tp':>3} {'sp':>2} {'pp':>3} {'schedule':<9}"
             f"{'cp':>3} {'dp':>4} {'zero':>4} {'mb×m':>8} {'ac':<9} {'offload':<9} split"]
    for i, p in enumerate(res.ranked, 1):
        s = p.spec
        lines.append(f"  {i:>2} {row(p, shape, cl)['tokens_per_s_per_gpu']:>10.1f} {p.step_s:>8.2f} {p.spans:<6}"
                     f"{s.tp:>3} {'y' if s.sp else '-':>2} {s.pp:>3} {(s.pp_schedule if s.pp > 1 else '-'):<9}"
                     f"{s.cp:>3} {s.dp:>4} {s.zero:>4} {f'{s.micro_batch}×{s.accum}':>8} {s.ac:<9} {s.offload:<9} "
                     f"{_split_text(p)}")
    if not res.ranked:
        lines.append("  (no mixed layout fits)")
    else:
        lines.append("best mixed layout, per device type:")
        lines += _per_type_lines(res.ranked[0])
    lines += _comparison_lines(res)
    return "\n".join(lines)


def _comparison_lines(res: MixedPlan) -> list[str]:
    cmp, g = comparison(res), res.alone_group
    tokens = res.global_batch * res.seq_len
    slower = [x for x in res.cluster.groups if x.gpu != g.gpu]
    added = " + ".join(f"{x.count} × {x.gpu.name}" for x in slower)
    if res.alone is None:
        return [f"fastest type alone: {g.count} × {g.gpu.name} fit no layout of this model and batch: the "
                f"slower cards are needed" + ("" if res.ranked else ", and no mixed layout fits either")]
    a = res.alone["layout"]
    lines = [f"fastest type alone: {g.count} × {g.gpu.name}, tp{a['tp']} pp{a['pp']} cp{a['cp']} dp{a['dp']} "
             f"zero{a['zero']} mb{a['micro_batch']}x{a['microbatches']} ac={a['ac']} offload={a['offload']}: step "
             f"{res.alone['step_s']:.2f} s, {tokens / res.alone['step_s']:,.0f} tokens/s"]
    if not res.ranked:
        return lines + [f"adding {added} does not pay: no mixed layout fits; train on the {g.gpu.name}s alone"]
    mixed = tokens / cmp["mixed_step_s"]
    if cmp["pays"]:
        lines.append(f"adding {added}: {mixed:,.0f} tokens/s, {cmp['gain']:+.1%} against the {g.gpu.name}s alone "
                     f"(they pay)")
    else:
        lines.append(f"adding {added} does not pay: the best mixed layout makes {mixed:,.0f} tokens/s, "
                     f"{cmp['gain']:+.1%} against the {g.gpu.name}s alone; train on the {g.gpu.name}s alone")
    return lines


def run_plan_mixed(args, cfg, shape: Shape, cluster: Cluster, seq: int, tokens: int, opts, fixed: dict,
                   knobs: dict) -> int:
    """The mixed search, printed (or --json), and --emit-config's TOML with parallel.devices and the
    planner's pp_layers or dp_weights. Raises PlanError / HardwareError on bad input (one line)."""
    res = plan_mixed(shape, cluster, seq, tokens, args.precision, args.top, fixed, opts, cfg.optim.name, knobs)
    if args.json:
        print(json.dumps({"cluster": cluster.items(), "ranked": [row(p, shape, cluster) for p in res.ranked],
                          "alone": res.alone, "comparison": comparison(res), "counts": dict(res.counts)}, indent=1))
    else:
        print(format_mixed(res, shape, cfg.optim.name))
    if args.explain:
        reasons = [f"  {n:>9,}  {why}" for why, n in res.reasons.most_common()] or ["  nothing"]
        print("\n".join(["discarded (mixed layouts):"] + reasons), file=sys.stderr if args.json else sys.stdout)
    if not res.ranked:
        return 1
    if args.emit_config:
        if args.emit_rank > len(res.ranked):
            raise PlanError(f"--emit-rank: only {len(res.ranked)} mixed layouts fit, no row {args.emit_rank}")
        with open(args.emit_config, "w") as f:
            f.write(C.to_toml(mixed_config(shape, res.ranked[args.emit_rank - 1], cluster, cfg)))
        if not args.json:
            print(f"wrote {args.emit_config}")
    return 0


def mixed_config(shape: Shape, p: Priced, cluster: Cluster, base) -> C.Config:
    """The config that trains a mixed layout: to_config's keys plus parallel.devices and the weights
    (with weights, parallel.microbatches stays 0: each replica's count is its own)."""
    cfg = to_config(shape, p.spec, base)
    w = _weights(p)
    cfg.parallel = dataclasses.replace(cfg.parallel, devices=cluster.items(), dp_weights=w,
                                       microbatches=0 if w else cfg.parallel.microbatches)
    return cfg


def estimate_mixed(shape: Shape, cfg, cluster: Cluster, opts) -> dict:
    """`meshlm estimate` of the config's layout on a mixed cluster: pipeline stages (pp > 1) or data
    replicas (pp = 1, with the config's dp_weights) each on its own card; a TP group across two types
    is refused in one line."""
    spec = spec_from_config(cfg, cluster.world)
    tp_span(cluster, spec.tp)
    if spec.pp > 1:
        p = price_pipeline(shape, spec, cluster, opts, simulate=True)
    else:
        p = price_data(shape, spec, cluster, opts)
    return row(p, shape, cluster)


def format_estimate_mixed(r: dict, cluster: Cluster) -> str:
    L = r["layout"]
    lines = [f"{r['gpus']} GPUs: {cluster.describe()}",
             "layout: " + ", ".join(f"{k}={v}" for k, v in L.items() if k != "devices"),
             f"fits: {'yes' if r['fits'] else 'NO'}; step {r['step_s']:.3f} s, {r['tokens_per_s_per_gpu']:.1f} tokens/s "
             f"per GPU, MFU {r['mfu']:.1%} (of the cluster's summed peak; pipeline makespan: {r['bubble_source']})"]
    for t in r["per_type"]:
        lines.append(f"  {t['gpu']:<16}{t['gpus']:>4} GPUs: {t['bytes'] / GIB:.2f} GiB of {t['usable'] / GIB:.2f} "
                     f"usable, compute {t['busy_s']:.3f} s per step")
    return "\n".join(lines)
