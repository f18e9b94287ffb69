"""Simulated engines, trace replay, the lab of real servers, and the replay evaluation."""
