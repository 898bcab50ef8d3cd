"""Pure decision code: functions of a job and a frozen snapshot (which carries ``now``).

Nothing here awaits, reads a clock, a file or global settings; the live broker and the simulator call
the very same functions.
"""
