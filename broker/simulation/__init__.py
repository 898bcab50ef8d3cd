"""The simulator's inputs and driver: the default federation built from real zones, prices and
latencies; the workload assumptions laid over a real trace; and (to come) the discrete-event driver that
runs the live scheduling cycle on a simulated clock."""
