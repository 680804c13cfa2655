"""`meshlm convert` and `meshlm generate` (argparse wiring; the work is in train/convert.py / generate.py)."""
from __future__ import annotations

import sys


def _fail(msg: str, code: int = 2) -> int:
    print(f"meshlm: {msg}", file=sys.stderr)
    return code


def run_convert(args) -> int:
    from .train.convert import from_hf, return_freed_memory, to_hf
    from .train.checkpoint import CheckpointError
    if bool(args.from_hf) == bool(args.to_hf):
        return _fail("convert: give exactly one of --from-hf DIR or --to-hf CKPT")
    if args.max_shard_gb <= 0:
        return _fail(f"--max-shard-gb: must be > 0, got {args.max_shard_gb}")
    return_freed_memory()  # one tensor at a time: resident memory follows it (train/convert.py)
    try:
        if args.from_hf:
            from_hf(args.from_hf, args.out)
            print(f"meshlm: wrote checkpoint {args.out} (weights only; train from HF weights with "
                  f"--model.init_from hf:{args.from_hf})")
        else:
            files = to_hf(args.to_hf, args.out, args.dtype, int(args.max_shard_gb * 1e9))
            print(f"meshlm: wrote {args.out} ({len(files)} safetensors file{'s' if len(files) > 1 else ''}, "
                  f"{args.dtype})")
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        return _fail(str(e).splitlines()[0])
    return 0


def run_generate(args) -> int:
    if args.max_new_tokens < 1:
        return _fail(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        return _fail("--temperature must be >= 0 and --top-p in (0, 1]")
    from .generate import continuation
    try:
        text = continuation(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_p,
                            args.seed, args.device)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    print(text)
    return 0


def add_parsers(sub) -> None:
    c = sub.add_parser("convert", help="Hugging Face Llama directory <-> meshlm checkpoint")
    c.add_argument("--from-hf", metavar="DIR", help="a transformers Llama directory (config.json + safetensors)")
    c.add_argument("--to-hf", metavar="CKPT", help="a meshlm checkpoint, or a run directory (its newest)")
    c.add_argument("--out", required=True, help="the directory to create (must not exist)")
    c.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="export dtype (default bf16)")
    c.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="export: safetensors files of at most this size, with an index (default 5)")
    c.set_defaults(func=run_convert)
    g = sub.add_parser("generate", help="continue a prompt from a checkpoint (KV cache, CPU or one GPU)")
    g.add_argument("checkpoint", help="a meshlm checkpoint, or a run directory (its newest)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.set_defaults(func=run_generate)
