"""Engine performance models fitted from benchmark files. Pure: no I/O, no clock, no threads."""
