"""Measuring: the interleaved bench, device profiles and the memory/speed planner."""
