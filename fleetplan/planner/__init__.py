"""The planner core. Pure: inputs in, a value out; no I/O, no clock, no threads."""
