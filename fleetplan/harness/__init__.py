"""Above the controller and the simulator: the command line, the lab servers, the demo."""
