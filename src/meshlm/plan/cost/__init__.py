"""The planner's cost model of one layout: memory (memory.py, activations.py), bytes moved (volume.py,
comm.py), operation times (ops.py), pipeline stages and bubbles (stages.py, estimate.py), and what
islands, Muon and failures add (islands.py, muon.py, goodput.py). `estimate` puts them together."""
