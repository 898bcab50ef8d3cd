"""Loaders for the real data the simulator and the policies run on: grid carbon intensity, GPU prices,
inter-region latency, region coordinates and job traces. Each loader validates what it reads and
reports problems with the file, row or zone; none guesses silently."""
