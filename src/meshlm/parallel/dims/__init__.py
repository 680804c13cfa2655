"""The parallel dimensions, one module (or small package) each: data_parallel (buckets) and zero/ (ZeRO 1-3,
HSDP, ZeRO++), tensor_parallel (+ sequence parallelism) and vocab_parallel, context_parallel (ring, Ulysses)
and cp_allgather, expert_parallel, pipeline/. `compose.parallelize` applies them to a plain model."""
