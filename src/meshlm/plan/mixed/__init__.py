"""Mixed clusters (docs/heterogeneous.md): layouts over GPUs of several types, priced (price.py), searched
(search.py) and printed (cli.py); the cluster description itself is plan/cluster.py."""
