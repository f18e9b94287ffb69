"""Adapters: daemon loop, Prometheus reader, MQTT, host agent, actuators, state store, report API, CLI."""
