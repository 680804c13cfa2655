"""The search over layouts: enumerate and rank (ranked.py), the grouped search that prices many layouts at
once (grouped.py), worker processes (workers.py), and parallel.auto's choice for a run (auto.py)."""
