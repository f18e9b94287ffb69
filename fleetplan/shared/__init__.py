"""File utilities shared by the controller and the simulator: atomic writes, benchmark files."""
