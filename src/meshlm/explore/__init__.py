"""`meshlm explore`: a local web page over the planner (strategy explorer) and over run directories
(runs dashboard). Standard library server, every asset shipped in `static/`."""
