"""Surviving what goes wrong: restarts, the checkpoint cadence and non-finite guards (fault), saving on a
signal (preempt), when the loop saves (saving), and loss spikes skipped or rolled back (spike)."""
